"""A user's components that break their contract, for the bad-input matrix (tests/runner/test_bad_input.py)."""
from __future__ import annotations


def splits_as_list() -> list:
    """A dataset builder that returns a list where DataSplits belongs."""
    return [[0.0, 1], [1.0, 0]]


def failing_builder() -> None:
    """A dataset builder that fails its own way."""
    raise KeyError("labels")
