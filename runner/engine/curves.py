"""curves.png: a run's loss curves (train and val) and accuracy curve (val) against optimizer steps.

Drawn with Pillow rather than matplotlib: importing matplotlib and laying out its figure cost about 0.9 s of
CPU at the end of every run (a tenth of a whole default run), Pillow's drawing a few hundredths. The chart
is drawn at twice its size and scaled down, which smooths its lines as matplotlib's antialiasing would.
Values are plotted as logged: non-finite ones are left out of the line (a gap), as matplotlib does.
"""
from __future__ import annotations

import math
from pathlib import Path

WIDTH, HEIGHT = 1000, 400  # pixels of the saved image (matplotlib's 10 x 4 inches at 100 dpi before)
_SCALE = 2                 # drawn at this multiple, then scaled down
_COLORS = {"train/loss": (31, 119, 180), "val/loss": (255, 127, 14), "val/acc": (31, 119, 180)}
_PANELS = (("loss", ("train/loss", "val/loss")), ("accuracy", ("val/acc",)))
_INK, _GRID, _PAPER = (0, 0, 0), (225, 225, 225), (255, 255, 255)


def draw(history: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    """The chart of `history` (metric -> (step, value) points) written to path; None without a training loss."""
    if "train/loss" not in history:
        return None
    from PIL import Image, ImageDraw, ImageFont

    s = _SCALE
    image = Image.new("RGB", (WIDTH * s, HEIGHT * s), _PAPER)
    pen = ImageDraw.Draw(image)
    font, title_font = ImageFont.load_default(11 * s), ImageFont.load_default(13 * s)
    half = WIDTH * s // 2
    for i, (title, names) in enumerate(_PANELS):
        box = (i * half + 62 * s, 30 * s, (i + 1) * half - 18 * s, HEIGHT * s - 48 * s)
        series = {name: [(x, y) for x, y in history[name] if math.isfinite(y)] for name in names if name in history}
        _panel(pen, box, title, series, font, title_font)
    image = image.resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _panel(pen, box, title, series, font, title_font) -> None:
    left, top, right, bottom = box
    s = _SCALE
    points = [p for values in series.values() for p in values]
    xs, ys = [x for x, _ in points] or [0, 1], [y for _, y in points] or [0, 1]
    x_ticks, (x_low, x_high) = _ticks(min(xs), max(xs))
    y_ticks, (y_low, y_high) = _ticks(min(ys), max(ys))

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_low) / (x_high - x_low) * (right - left),
                bottom - (y - y_low) / (y_high - y_low) * (bottom - top))

    for x in x_ticks:
        px, _ = at(x, y_low)
        pen.line([(px, top), (px, bottom)], fill=_GRID, width=s)
        pen.line([(px, bottom), (px, bottom + 4 * s)], fill=_INK, width=s)
        pen.text((px, bottom + 6 * s), _label(x), fill=_INK, font=font, anchor="mt")
    for y in y_ticks:
        _, py = at(x_low, y)
        pen.line([(left, py), (right, py)], fill=_GRID, width=s)
        pen.line([(left - 4 * s, py), (left, py)], fill=_INK, width=s)
        pen.text((left - 6 * s, py), _label(y), fill=_INK, font=font, anchor="rm")
    pen.rectangle(box, outline=_INK, width=s)
    pen.text(((left + right) / 2, top - 8 * s), title, fill=_INK, font=title_font, anchor="md")
    pen.text(((left + right) / 2, bottom + 24 * s), "optimizer step", fill=_INK, font=font, anchor="mt")
    for name, values in series.items():
        color = _COLORS.get(name, _INK)
        line = [at(x, y) for x, y in values]
        if len(line) > 1:
            pen.line(line, fill=color, width=2 * s, joint="curve")
        if name.startswith("val") or len(line) == 1:  # dots: each evaluation, or the one value there is
            for px, py in line:
                pen.ellipse((px - 3 * s, py - 3 * s, px + 3 * s, py + 3 * s), fill=color)
    if series:  # the legend, top right, on white over the curves
        width = max(pen.textlength(name, font=font) for name in series) + 44 * s
        pen.rectangle((right - width - 8 * s, top + 4 * s, right - 4 * s, top + (8 + 18 * len(series)) * s),
                      fill=_PAPER, outline=(200, 200, 200), width=s)
        for row, name in enumerate(series):
            y = top + (15 + 18 * row) * s
            pen.line([(right - width, y), (right - width + 24 * s, y)], fill=_COLORS.get(name, _INK), width=2 * s)
            pen.text((right - width + 30 * s, y), name, fill=_INK, font=font, anchor="lm")


def _ticks(low: float, high: float) -> tuple[list[float], tuple[float, float]]:
    """About five round tick values spanning [low, high], and the axis's range (the data's, padded 5%)."""
    if high - low <= 0:
        low, high = low - (abs(low) or 1) * 0.05, high + (abs(high) or 1) * 0.05
    pad = (high - low) * 0.05
    low, high = low - pad, high + pad
    raw = (high - low) / 5
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)], (low, high)


def _label(value: float) -> str:
    return f"{value:.6g}" if abs(value) >= 1e-4 or value == 0 else f"{value:.1e}"
