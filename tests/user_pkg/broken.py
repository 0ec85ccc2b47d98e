"""A user's components that break their contract, for the bad-input matrix (tests/runner/test_bad_input.py)."""
from __future__ import annotations


def splits_as_list() -> list:
    """A dataset builder that returns a list where DataSplits belongs."""
    return [[0.0, 1], [1.0, 0]]


def failing_builder() -> None:
    """A dataset builder that fails its own way."""
    raise KeyError("labels")


def three_scores(in_features: int = 64):
    """A classifier with a fixed 3 outputs, whatever the data's classes."""
    import torch

    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_features, 3))


def thirty_scores(in_features: int = 64):
    """A classifier with a fixed 30 outputs, whatever the data's classes."""
    import torch

    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_features, 30))


def raising_forward():
    """A model whose forward fails its own way."""
    import torch

    class Raising(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 10)

        def forward(self, x):
            raise ValueError("this model is not finished")

    return Raising()
