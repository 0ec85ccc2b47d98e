"""runner/engine/curves.py: curves.png drawn with Pillow (no matplotlib import at the end of a run)."""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image

from runner.engine.curves import HEIGHT, WIDTH, draw

HISTORY = {"train/loss": [(s, 2.3 * math.exp(-s / 60)) for s in range(0, 400, 10)],
           "val/loss": [(s, 0.1 + 1 / (s + 1)) for s in range(20, 420, 20)],
           "val/acc": [(s, 0.9 + 0.07 * (1 - math.exp(-s / 100))) for s in range(20, 420, 20)]}


def _near(image: Image.Image, color: tuple[int, int, int], box: tuple[int, int, int, int]) -> int:
    """Pixels within 40 of `color` (per channel) inside box."""
    region = image.crop(box).getdata()
    return sum(all(abs(a - b) <= 40 for a, b in zip(pixel, color)) for pixel in region)


def test_the_curves_are_a_png_with_each_series_drawn_in_its_panel(tmp_path: Path) -> None:
    path = draw(HISTORY, tmp_path / "sub" / "curves.png")
    assert Image.open(path).format == "PNG"
    image = Image.open(path).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    left, right = (0, 0, WIDTH // 2, HEIGHT), (WIDTH // 2, 0, WIDTH, HEIGHT)
    assert _near(image, (255, 127, 14), left) > 200    # val/loss (orange) in the loss panel
    assert _near(image, (255, 127, 14), right) == 0    # and nowhere else
    assert _near(image, (31, 119, 180), left) > 200    # train/loss
    assert _near(image, (31, 119, 180), right) > 200   # val/acc
    # the loss panel's first training loss (2.3, the largest value) sits near the top of its plot area
    top_blue = min(y for y in range(HEIGHT) for x in range(60, 90)
                   if all(abs(a - b) <= 40 for a, b in zip(image.getpixel((x, y)), (31, 119, 180))))
    assert top_blue < 60


def test_no_training_loss_draws_nothing_and_non_finite_values_are_gaps(tmp_path: Path) -> None:
    assert draw({"val/acc": [(1, 0.5)]}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    assert draw({"train/loss": [(0, float("nan")), (1, 2.0), (2, math.inf), (3, 1.0)]}, tmp_path / "gaps.png")
    assert draw({"train/loss": [(0, 1.0)]}, tmp_path / "one.png")  # one value: a dot, a range around it
