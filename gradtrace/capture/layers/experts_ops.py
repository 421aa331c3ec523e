"""The kernels of the fused experts' rule (``gradtrace.capture.layers.experts``): routed pairs sorted by expert, the
per-pair products with each pair's expert weights, and per-(row, expert) sums of outer products -- each a grouped
matrix product where the kernel takes the dtype and widths, blocks of pairs otherwise; no Python loop over experts,
examples or tokens, and no host read."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Routing", "accumulation", "blocks", "expert_linear", "segment_outer_sums"]

_PAIR_BLOCK = 1 << 24
"""Numbers of the per-pair gathered weights (or per-pair outer products) formed at a time (64 MiB of float32)."""

class Routing:
    """The routed pairs of an experts call, sorted by expert (stable): pair ``i`` of the sorted order is original pair
    ``order[i]`` (= token ``order[i] // k``, slot ``order[i] % k``), routed to ``expert[i]``; ``offsets[e]`` is the end
    of expert ``e``'s pairs. Built on the device without a host read."""

    def __init__(self, index: Tensor, experts: int) -> None:
        flat = index.reshape(-1)  # [P]
        self.k = index.shape[-1]
        self.order = torch.argsort(flat, stable=True)
        self.expert = flat.index_select(0, self.order)
        self.token = self.order // self.k
        counts = torch.zeros(experts, dtype=torch.int32, device=index.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32)

    def segments(self, rows: int) -> tuple[Tensor, Tensor]:
        """The pairs' (expert, row) groups for ``rows`` rows of equal length: ``segment [P]`` (``expert * rows +
        row`` of each sorted pair) and ``ends [E*rows]`` int32, the end of each group. The sort is stable and the
        pairs token-major, so each expert's pairs are in row order: ``segment`` is nondecreasing and every group a
        contiguous run of pairs."""
        groups = self.offsets.shape[0] * rows
        segment = self.expert * rows + self.token // max(1, self.token.shape[0] // (rows * self.k))
        counts = torch.zeros(groups, dtype=torch.int32, device=segment.device)
        counts.index_add_(0, segment, torch.ones_like(segment, dtype=torch.int32))
        return segment, torch.cumsum(counts, 0, dtype=torch.int32)

    def unsort(self, values: Tensor) -> Tensor:
        """Per-pair values ``[P, ...]`` from sorted order back to the original (token-major) order."""
        out = torch.empty_like(values)
        out[self.order] = values
        return out


def expert_linear(x: Tensor, weight: Tensor, routing: Routing, transposed: bool) -> Tensor:
    """``x_i W[e_i]^T`` for each routed pair (``x_i W[e_i]`` when ``transposed``), pairs in ``routing``'s order.

    x: ``[P, n_in]``; weight: ``[E, n_out, n_in]`` (``[E, n_in, n_out]`` when transposed). Returns ``[P, n_out]`` in
    ``x``'s dtype with work proportional to the routed pairs and no host read: one grouped matrix product
    (``torch.nn.functional.grouped_mm``) where the kernel takes the dtype and shapes, else blocks of pairs that each
    gather their pairs' weights (at most :data:`_PAIR_BLOCK` numbers).
    """
    grouped = _grouped(x, weight, routing, transposed)
    if grouped is not None:
        return grouped
    per_pair = weight.shape[1] * weight.shape[2]
    step = max(1, _PAIR_BLOCK // max(per_pair, 1))
    outs = []
    for start in range(0, x.shape[0], step):  # blocks of pairs, not a loop over tokens
        w = weight.index_select(0, routing.expert[start:start + step]).to(x.dtype)  # [p, ., .]
        v = x[start:start + step].unsqueeze(1)  # [p, 1, n_in]
        outs.append(torch.bmm(v, w if transposed else w.transpose(1, 2)).squeeze(1))
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[2] if transposed else weight.shape[1])


_NO_GROUPED: set[tuple] = set()
"""(device type, dtype, weight shape, layout) for which the grouped kernel refused: not tried again."""


def _grouped(x: Tensor, weight: Tensor, routing: Routing, transposed: bool) -> Tensor | None:
    """:func:`expert_linear` by one grouped product; None where the kernel is missing or refuses the dtype or shapes
    (float64, widths not a multiple of 16 bytes, older GPUs)."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    key = (x.device.type, x.dtype, tuple(weight.shape), transposed)
    if grouped_mm is None or key in _NO_GROUPED or x.dtype != weight.dtype or x.shape[0] == 0:
        return None
    mat_b = weight if transposed else weight.transpose(1, 2)  # [E, n_in, n_out]
    try:
        return grouped_mm(x.contiguous(), mat_b, offs=routing.offsets)
    except (RuntimeError, NotImplementedError):
        _NO_GROUPED.add(key)
        return None


def accumulation(x: Tensor) -> torch.dtype:
    """float32 for 16- and 32-bit values, float64 for float64 ones."""
    return torch.promote_types(x.dtype, torch.float32)


def segment_outer_sums(rows: Tensor, cols: Tensor, segment: Tensor, ends: Tensor) -> Tensor:
    """``out[s] = sum_{p in group s} rows_p (x) cols_p``: ``[S, R, C]`` (float32, or float64 for float64 factors)
    from ``[P, R]``, ``[P, C]`` whose groups are contiguous runs of pairs (group ``s`` ends at ``ends[s]``; ``segment
    [P]``: each pair's group).

    One grouped product over the pairs (``grouped_mm`` of ``rows^T`` and ``cols`` split along the pairs, as a weight
    gradient is computed; 16-bit factors multiplied into float32, which is exact) where the kernel takes the dtype and
    widths; else blocks of per-pair outer products added into their groups' rows (at most :data:`_PAIR_BLOCK` numbers
    at a time)."""
    dtype = accumulation(rows)
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    key = ("segments", rows.device.type, rows.dtype, rows.shape[1], cols.shape[1])
    if grouped_mm is not None and key not in _NO_GROUPED and rows.dtype == cols.dtype and dtype == torch.float32:
        try:
            out_dtype = None if rows.dtype == dtype else dtype
            return grouped_mm(rows.t(), cols, offs=ends, out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError):
            _NO_GROUPED.add(key)
    out = rows.new_zeros(ends.shape[0], rows.shape[1] * cols.shape[1], dtype=dtype)  # 2-D: a row-wise index_add
    step = max(1, _PAIR_BLOCK // max(rows.shape[1] * cols.shape[1], 1))
    for start in range(0, rows.shape[0], step):  # blocks of pairs
        r, c = rows[start:start + step].to(dtype), cols[start:start + step].to(dtype)
        out.index_add_(0, segment[start:start + step], (r.unsqueeze(2) * c.unsqueeze(1)).flatten(1))
    return out.view(ends.shape[0], rows.shape[1], cols.shape[1])


def blocks(values: Tensor, expert: Tensor, experts: int) -> Tensor:
    """Place per-pair vectors ``[P, n]`` in their expert's block of a ``[P, E*n]`` tensor (zeros elsewhere)."""
    dtype = accumulation(values)
    out = values.new_zeros(values.shape[0], experts, values.shape[1], dtype=dtype)
    out.scatter_(1, expert.view(-1, 1, 1).expand(-1, 1, values.shape[1]), values.to(dtype).unsqueeze(1))
    return out.reshape(values.shape[0], -1)
