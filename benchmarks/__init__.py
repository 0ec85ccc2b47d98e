"""Benchmarks (`make bench*`): outside the library's import graph; run from the checkout's root."""
