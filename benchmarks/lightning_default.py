"""The work of runner's default run (`python -m runner`), written as a PyTorch Lightning user would, with
Lightning's defaults: benchmarks/bench_startup.py times whole runs of both (`--whole N`). Needs lightning
(not one of runner's dependencies): `python -m benchmarks.lightning_default [--mlflow]`.

The same work as conf/'s defaults: the 8x8 digits with runner's own split and standardization (the same
tensors: runner/data/digits.py, which reads them without scikit-learn, so Lightning is not charged
for its import), runner's default MLP (hidden 256, 128) under seed 0, Adam (lr 1e-3, its foreach
kernel, as runner picks on a CPU), batch 64 with the training set shuffled, 20 epochs, a validation
after each (loss, accuracy, top-5), the training loss logged every 10 steps, the weights of the best
validation accuracy kept and tested at the end. Everything else is Lightning's default: its logger
(TensorBoard when installed, else CSV files; `--mlflow`: MLFlowLogger on an sqlite store as runner's),
its checkpointing, progress bar, model summary and sanity-check validation.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from runner.data import digits
from runner.models.mlp import MLP

EPOCHS, BATCH, LR, LOG_EVERY = 20, 64, 1e-3, 10


class DigitsClassifier(L.LightningModule):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.model = MLP(input_shape, num_classes, hidden=[256, 128])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def _evaluate(self, batch, split: str) -> None:
        x, y = batch
        logits = self.model(x)
        top5 = (logits.topk(5, dim=1).indices == y[:, None]).any(dim=1).float().mean()
        self.log_dict({f"{split}/loss": F.cross_entropy(logits, y), f"{split}/acc": (logits.argmax(1) == y).float().mean(),
                       f"{split}/top5": top5}, batch_size=len(y))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR, foreach=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlflow", action="store_true", help="log to MLflow (sqlite under outputs/, as runner) instead "
                                                              "of Lightning's default logger")
    parser.add_argument("--root", default="lightning_runs", help="Lightning's default_root_dir")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"runner's default: {EPOCHS}")
    args = parser.parse_args(argv)
    L.seed_everything(0)
    data = digits.build()
    model = DigitsClassifier(data.input_shape, data.num_classes)
    logger: object = True  # Lightning's default
    if args.mlflow:
        from lightning.pytorch.loggers import MLFlowLogger

        Path("outputs").mkdir(exist_ok=True)
        logger = MLFlowLogger(experiment_name="lightning", tracking_uri="sqlite:///outputs/mlflow.db")
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, log_every_n_steps=LOG_EVERY, logger=logger,
                        default_root_dir=args.root,
                        callbacks=[ModelCheckpoint(monitor="val/acc", mode="max")])
    trainer.fit(model, DataLoader(data.train, batch_size=BATCH, shuffle=True),
                DataLoader(data.val, batch_size=BATCH))
    return trainer.test(model, DataLoader(data.test, batch_size=BATCH), ckpt_path="best")[0]


if __name__ == "__main__":
    main()
