"""The reference for the start-up figure: a hand-written PyTorch script doing the default run's work up to its
first optimizer step (the digits read as runner reads them, the same MLP 64-256-128-10, Adam, batch 64),
printing its CPU seconds there in bench_startup's FirstStep format. Nothing else: no config, no tracking,
no checks, no run directory. What a run costs beyond this is runner's own start-up."""
from __future__ import annotations

import os

import torch
from torch import nn

from benchmarks.bench_startup import FIRST_STEP_MARK
from runner.data.digits import load_digits


def main() -> None:
    torch.manual_seed(0)
    images, labels = load_digits()
    x = torch.from_numpy(images).float().flatten(1)
    y = torch.from_numpy(labels).long()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
        cpu = os.times()
        print(f"{FIRST_STEP_MARK}{cpu.user + cpu.system:.3f} 0", flush=True)
        break


if __name__ == "__main__":
    main()
