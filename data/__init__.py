"""Built-in datasets, written as a user writes their own: builders named by `_target_` in
conf/dataset/<name>.yaml that return DataSplits (runner/data/splits.py). The engine never imports this
package by name."""
from runner.data.splits import DataSplits, TokenSplits, split_indices

__all__ = ["DataSplits", "TokenSplits", "split_indices"]
