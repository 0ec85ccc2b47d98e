"""Language modelling: next-token cross-entropy averaged over every token that is not padding (labels
-100), exactly, across micro-batches and ranks; perplexity. Labels are already the next tokens (the
data shifts them)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from runner.tasks import IGNORE, Task, functional, units_kept

if TYPE_CHECKING:
    import torch


class LanguageModeling(Task):
    metrics = {"loss": "minimize", "ppl": "minimize"}
    unit = "tokens"
    predicts_from = "prompts"  # mode=predict continues prompts (generate), one a line of a text file

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def count(self, labels: torch.Tensor) -> int | torch.Tensor:
        return units_kept(labels)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        F = functional()  # torch's, imported once, not at the top: see runner/tasks/__init__.py

        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.nn.functional as F

        return {"loss": F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum",
                                        ignore_index=IGNORE)}

    def summarize(self, sums: dict[str, float], count: float) -> dict[str, float]:
        loss = sums["loss"] / count
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def loss_options(self) -> dict[str, Any]:
        return {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}

    def generate(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int, temperature: float,
                 top_k: int | None, generator: torch.Generator, context: int | None = None) -> list[int]:
        """mode=predict: the token ids continuing `prompt` (see `generate`)."""
        return generate(model, prompt, max_new_tokens, temperature, top_k, generator, context)


def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int | None,
             generator: torch.Generator, context: int | None = None) -> list[int]:
    """The new token ids after `prompt`, one forward per token over the last `context` tokens (nanoGPT's
    loop): greedy at temperature 0, else sampled (among the top_k likeliest) from `generator`."""
    import torch

    from runner.tasks.batches import logits_of

    device = next(model.parameters()).device
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = logits_of(model(x if context is None else x[:, -context:]))[:, -1, :].float()
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            x = torch.cat([x, token], dim=1)
    return x[0, len(prompt):].tolist()
