"""Inline SVG plots drawn by hand (no plotting dependency): a score histogram with markers.

The markup holds numbers only (no user text), so it is safe to insert unescaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from markupsafe import Markup
from torch import Tensor

__all__ = ["histogram_svg"]

WIDTH, HEIGHT, PAD_X, PAD_TOP, PAD_BOTTOM = 340, 96, 6, 4, 16


def _num(value: float) -> str:
    return f"{value:.4g}"


def histogram_svg(values: Tensor, helpful: Sequence[float] = (), harmful: Sequence[float] = (),
                  bins: int = 48) -> Markup:
    """A histogram of ``values`` (``[N]`` finite scores) with bar heights on a log scale (``log(1 + count)``, so
    the few examples in the tails stay visible), green ticks at the ``helpful`` scores, red ticks at the
    ``harmful`` ones, and a dashed line at zero when it is in range."""
    values = values.detach().to(torch.float64).flatten()
    low, high = float(values.min()), float(values.max())
    if high - low <= 1e-12 * max(1.0, abs(high)):  # all (nearly) equal: one bar around the value
        low, high = low - 0.5 * max(abs(low), 1e-12), high + 0.5 * max(abs(high), 1e-12)
    counts = torch.histc(values, bins=bins, min=low, max=high)  # [bins]
    heights = torch.log1p(counts) / math.log1p(float(counts.max()))
    plot_w, plot_h = WIDTH - 2 * PAD_X, HEIGHT - PAD_TOP - PAD_BOTTOM
    base = PAD_TOP + plot_h
    step = plot_w / bins
    x_of = lambda v: PAD_X + (v - low) / (high - low) * plot_w
    bars = "".join(f"M{PAD_X + i * step:.1f} {base}v{-h * plot_h:.1f}h{step * 0.9:.1f}v{h * plot_h:.1f}z"
                   for i, h in enumerate(heights.tolist()) if h > 0)
    ticks = lambda marks: "".join(f"M{x_of(v):.1f} {PAD_TOP}V{base}" for v in marks)
    parts = [f'<svg class="hist" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">',
             f'<path class="hb" d="{bars}"/>']
    if low < 0 < high:
        parts.append(f'<path class="h0" d="M{x_of(0.0):.1f} {PAD_TOP}V{base}"/>')
    if helpful:
        parts.append(f'<path class="hp" d="{ticks(helpful)}"/>')
    if harmful:
        parts.append(f'<path class="hn" d="{ticks(harmful)}"/>')
    parts.append(f'<path class="ha" d="M{PAD_X} {base}H{WIDTH - PAD_X}"/>')
    parts.append(f'<text x="{PAD_X}" y="{HEIGHT - 3}">{_num(low)}</text>'
                 f'<text x="{WIDTH - PAD_X}" y="{HEIGHT - 3}" text-anchor="end">{_num(high)}</text>')
    if low < 0 < high:
        parts.append(f'<text x="{x_of(0.0):.1f}" y="{HEIGHT - 3}" text-anchor="middle">0</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
