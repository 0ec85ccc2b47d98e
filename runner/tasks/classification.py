"""Classification: cross-entropy (optionally label-smoothed) over classes; top-1 and, with more than 5
classes, top-5 accuracy. Labels are class ids, or class probabilities [B, C] (mixup/cutmix)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.tasks import IGNORE, Task, functional, units_kept

if TYPE_CHECKING:
    import torch


class Classification(Task):
    metrics = {"loss": "minimize", "acc": "maximize", "top5": "maximize"}

    def __init__(self, label_smoothing: float = 0.0, num_classes: int | None = None):
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes  # the data's, where it says: a model's output must have as many
        if (num_classes or 0) <= 5:  # top-5 of 5 classes or fewer is always 1
            self.metrics = {k: v for k, v in self.metrics.items() if k != "top5"}

    def count(self, labels: torch.Tensor) -> int | torch.Tensor:
        return len(labels) if labels.is_floating_point() else units_kept(labels)

    def check_outputs(self, logits: torch.Tensor) -> None:
        """A model with another number of outputs than the data has classes is refused: fewer fail on the first
        label beyond them, more train silently with classes that never occur."""
        if self.num_classes and logits.shape[-1] != self.num_classes:
            from runner.specs.fields import SpecError

            raise SpecError(f"model: it outputs {logits.shape[-1]} scores per sample, but the data has "
                            f"{self.num_classes} classes; allowed: a model with {self.num_classes} outputs (a model "
                            "taking num_classes gets it from the data)")

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        F = functional()  # torch's, imported once, not at the top: see runner/tasks/__init__.py

        self.check_outputs(logits)
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.nn.functional as F

        self.check_outputs(logits)
        logits = logits.float()
        hard = labels.argmax(dim=-1) if labels.is_floating_point() else labels
        sums = {"loss": F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE),
                "acc": (logits.argmax(dim=-1) == hard).sum()}
        if "top5" in self.metrics:
            sums["top5"] = (logits.topk(min(5, logits.shape[-1]), dim=-1).indices == hard.unsqueeze(-1)).any(dim=-1).sum()
        return sums

    def loss_options(self) -> dict[str, Any]:
        return {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}

    def prediction_rows(self, logits: torch.Tensor, labels: torch.Tensor | None) -> list[dict[str, Any]]:
        """The likeliest class and every class's probability; the true class where labels are given."""
        import torch

        probs = torch.softmax(logits.float(), dim=-1).cpu()
        hard = None if labels is None else (labels.argmax(dim=-1) if labels.is_floating_point() else labels).cpu()
        rows = []
        for i, p in enumerate(probs):
            row: dict[str, Any] = {"predicted": int(p.argmax())}
            if hard is not None:
                row["label"] = int(hard[i])
            rows.append({**row, "probabilities": [round(float(v), 6) for v in p]})
        return rows
