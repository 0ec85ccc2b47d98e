"""The dataset group (conf/dataset/<name>.yaml, and conf/loader.yaml for the loader's keys): a builder named
by `_target_` and its own arguments, plus the loader's keys, which are runner's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.specs.fields import Component, SpecError, build, component_dict, opt


@dataclass(frozen=True)
class DatasetSpec(Component):
    """A dataset builder named by `_target_` and its own arguments (conf/dataset/<name>.yaml), plus the
    loader's keys, which are runner's: the builder never sees them."""

    target: str = "runner.data.digits.build"
    # the upper bound only refuses the absurd; the engine checks the batch against the training split
    batch_size: int = opt(64, "samples per device per micro-step", gt=0, le=2**20)
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)
    params: dict = field(default_factory=dict)

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, "batch_size": self.batch_size, "num_workers": self.num_workers, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str = "dataset") -> "DatasetSpec":
        data = component_dict(data, key)
        loader = {k: data.pop(k) for k in ("batch_size", "num_workers") if k in data}
        built = build(_LoaderKeys, loader, f"{key}.")
        return cls(target=data.pop("_target_"), batch_size=built.batch_size, num_workers=built.num_workers, params=data)

    def fraction(self, split: str) -> float:
        """The share of the data the builder carves for `split` (its `<split>_fraction`); 0 when it takes none."""
        value = self.params.get(f"{split}_fraction", 0.0)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


@dataclass(frozen=True)
class _LoaderKeys:
    batch_size: int = opt(64, "samples per device per micro-step", gt=0, le=2**20)
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)


def check_dataset(dataset: DatasetSpec) -> None:
    """RunSpec.validate's rule across the dataset's keys."""
    if dataset.fraction("val") + dataset.fraction("test") >= 1:
        raise SpecError("dataset.val_fraction: val_fraction + test_fraction must be < 1")
