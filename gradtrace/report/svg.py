"""Inline SVG plots drawn by hand (no plotting dependency): a score histogram with markers.

The markup holds numbers only (no user text), so it is safe to insert unescaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from markupsafe import Markup
from torch import Tensor

__all__ = ["histogram_counts", "histogram_of", "histogram_svg"]

WIDTH, HEIGHT, PAD_X, PAD_TOP, PAD_BOTTOM = 340, 96, 6, 4, 16
ZERO_LABEL_GAP = 44  # px kept free around the end labels


def _num(value: float) -> str:
    return f"{value:.4g}"


def histogram_counts(values: Tensor, bins: int = 48) -> tuple[Tensor, Tensor, Tensor]:
    """Histograms of the rows of ``values`` (``[R, N]`` finite scores) in one pass: ``(counts [R, bins], low [R],
    high [R])``, each row binned evenly over its own range (the maximum falls in the last bin). A row whose values
    are all (nearly) equal gets a range of its value +- half its magnitude."""
    values = values.detach().to(torch.float64)  # [R, N]
    low, high = values.min(dim=1).values, values.max(dim=1).values  # [R]
    flat = (high - low) <= 1e-12 * high.abs().clamp_min(1.0)
    pad = 0.5 * torch.maximum(torch.maximum(low.abs(), high.abs()), torch.full_like(low, 1e-12))
    low, high = torch.where(flat, low - pad, low), torch.where(flat, high + pad, high)
    # torch.histc's bin of each value, (x - low) * bins / (high - low), in the same order of operations
    index = ((values - low[:, None]) * bins / (high - low)[:, None]).floor().long().clamp_(0, bins - 1)  # [R, N]
    counts = torch.zeros(values.shape[0], bins, dtype=torch.float64).scatter_add_(
        1, index, torch.ones_like(values))
    return counts, low, high


def histogram_svg(counts: Tensor, low: float, high: float, helpful: Sequence[float] = (),
                  harmful: Sequence[float] = ()) -> Markup:
    """One histogram (``counts [bins]`` over ``[low, high]``) with bar heights on a log scale (``log(1 + count)``,
    so the few examples in the tails stay visible), green ticks at the ``helpful`` scores, red ticks at the
    ``harmful`` ones, and a dashed line at zero when it is in range."""
    bins = counts.numel()
    plot_w, plot_h = WIDTH - 2 * PAD_X, HEIGHT - PAD_TOP - PAD_BOTTOM
    heights = (torch.log1p(counts) / math.log1p(float(counts.max())) * plot_h).round().long().tolist()  # px
    base = PAD_TOP + plot_h
    step = plot_w / bins
    x_of = lambda v: PAD_X + (v - low) / (high - low) * plot_w
    # one filled step outline (a few bytes per bin): up to each bin's height, across it, down at the end
    bars = f"M{PAD_X} {base}" + "".join(f"V{base - h}H{PAD_X + (i + 1) * step:.4g}" for i, h in enumerate(heights)) \
        + f"V{base}Z"
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
    if low < 0 < high and ZERO_LABEL_GAP < x_of(0.0) < WIDTH - ZERO_LABEL_GAP:  # not over the end labels
        parts.append(f'<text x="{x_of(0.0):.1f}" y="{HEIGHT - 3}" text-anchor="middle">0</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram_of(values: Tensor, helpful: Sequence[float] = (), harmful: Sequence[float] = (),
                 bins: int = 48) -> Markup:
    """:func:`histogram_svg` of ``values`` (``[N]``)."""
    counts, low, high = histogram_counts(values.reshape(1, -1), bins)
    return histogram_svg(counts[0], float(low[0]), float(high[0]), helpful, harmful)
