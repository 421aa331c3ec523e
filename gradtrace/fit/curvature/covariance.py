"""Accumulating curvature statistics from captured gradients (sums in ``FitOptions.covariance_dtype``, float32 by
default; counts in float64).

:class:`CovarianceCallback` is a capture callback: during training (or a separate pass over a dataset,
see :func:`gradtrace.fit.curvature.fit_curvature`) it sums, per block,

* Kronecker blocks: ``R = sum_t r_t r_t^T`` and ``C = sum_t c_t c_t^T`` over the tokens of the weight's
  gradient factors (``G_n = sum_t r_t c_t^T``), with the bias column on the activation side; one-hot
  (embedding) factors give diagonal sums (token counts). Only tokens that carry gradient are counted.
* dense blocks: ``F = sum_n g_n g_n^T`` (or its diagonal) over per-example gradients.

:class:`EigenCorrectionCallback` is the EK-FAC second pass: with the Kronecker eigenbases ``Q_R``, ``Q_C``
fixed, it sums ``(Q_R^T G_n Q_C)^2`` over examples.

Both form each batch's contribution where the batch is (the device) in ``dtype``; with ``offload`` the running sums
live on the CPU and each contribution is copied there and added (device memory then holds one batch's statistics).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...capture.callbacks import CaptureCallback
from ...grad.batch import GradientBatch, ParamGradient
from ...grad.terms import OuterTerm, is_index
from .blocks import Block, DenseBlock, KronBlock

__all__ = ["CovarianceCallback", "EigenCorrectionCallback", "block_factors", "KronStats", "DenseStats",
           "rotated_example_grads"]

_MAX_DENSE_FACTOR = 8192


class KronStats:
    """Running sums of one Kronecker block: row/column second moments, token and example counts."""

    def __init__(self, block: KronBlock) -> None:
        self.block = block
        self.rows: Tensor | None = None  # [n, n] or [n] (diagonal)
        self.cols: Tensor | None = None
        self.tokens: float | Tensor = 0.0  # a float64 tensor on the factors' device once a batch is added
        self.examples = 0.0

    @staticmethod
    def _add(total: Tensor | None, part: Tensor) -> Tensor:
        if total is None:
            return part
        if total.dim() != part.dim():  # one side mixes one-hot and dense factors (tied weights): go dense
            total = torch.diag(total) if total.dim() == 1 else total
            part = torch.diag(part) if part.dim() == 1 else part
        return total + part


class DenseStats:
    def __init__(self, block: DenseBlock) -> None:
        self.block = block
        self.total: Tensor | None = None  # [d, d] or [d]
        self.examples = 0.0


def _with_ones(factor: Tensor, live: Tensor) -> Tensor:
    """Append the bias column (1 on tokens that carry gradient) to a dense factor ``[E, T, n]`` (float32, or float64
    for a float64 factor)."""
    dtype = torch.promote_types(factor.dtype, torch.float32)
    return torch.cat([factor.to(dtype), live.to(dtype).unsqueeze(-1)], dim=-1)


def block_factors(block: KronBlock, grads: dict[str, ParamGradient]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per use site of the block's weight: ``(rows, cols, live)`` factors with the bias joined.

    rows/cols: ``[E, T, n]`` floats or ``[E, T]`` ids; live: ``[E, T]`` bool, tokens carrying gradient.
    """
    weight = grads[block.name]
    out = []
    for term in weight.terms:
        if not isinstance(term, OuterTerm):
            raise ValueError(f"curvature: {block.name} is not factorized (capture it without reducing tokens: "
                             "exact, or LoGra(keep_tokens=True))")
        grad_side = term.cols if block.act_side == "rows" else term.rows
        if is_index(grad_side):
            live = grad_side >= 0
        else:
            live = grad_side.to(torch.float32).abs().sum(-1) > 0
        rows, cols = term.rows, term.cols
        if block.bias is not None:
            if block.act_side == "cols":
                cols = _with_ones(cols, live)
            else:
                rows = _with_ones(rows, live)
        out.append((rows, cols, live))
    return out


def _second_moment(factor: Tensor, width: int, live: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``sum`` over live tokens of ``f f^T`` (dense ``[n, n]``) or of one-hot counts (``[n]``), formed in ``dtype``.

    Dead tokens are multiplied by 0 rather than selected out: a boolean selection (or ``bincount``, which sizes its
    result from the data) reads the mask on the host, once per layer per batch, which on a GPU stops the CPU."""
    if is_index(factor):
        counted = (live & (factor >= 0)).reshape(-1).to(dtype)
        return torch.zeros(width, dtype=dtype, device=factor.device).index_add_(
            0, factor.clamp(min=0).reshape(-1), counted)
    if factor.shape[-1] > _MAX_DENSE_FACTOR:
        raise ValueError(f"curvature would need a dense {factor.shape[-1]}x{factor.shape[-1]} factor; exclude this "
                         "layer or use a LoGra projection")
    flat = (factor.to(dtype) * live.unsqueeze(-1).to(dtype)).reshape(-1, factor.shape[-1])
    return flat.t() @ flat


def _flat_grad(pg: ParamGradient, dtype: torch.dtype = torch.float32) -> Tensor:
    return pg.flat(dtype)


def _kept(part: Tensor, offload: bool) -> Tensor:
    """A batch's contribution where the running sums live: the CPU with ``offload``, else where it was formed."""
    return part.to("cpu") if offload else part


class CovarianceCallback(CaptureCallback):
    """Capture callback accumulating K-FAC factors and dense Fisher blocks (see module docstring).

    dtype: the dtype the statistics are formed and summed in (``FitOptions.covariance_dtype``); offload: keep the
    sums on the CPU (``FitOptions.offload``)."""

    def __init__(self, blocks: list[Block], dtype: torch.dtype = torch.float32, offload: bool = False) -> None:
        self.blocks = blocks
        self.stats = {b.name: (KronStats(b) if isinstance(b, KronBlock) else DenseStats(b)) for b in blocks}
        self.examples = 0
        self.dtype = dtype
        self.offload = offload

    def on_batch(self, batch: GradientBatch, capture=None) -> None:
        keep = None
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            keep = (~batch.nonfinite).nonzero().flatten().tolist()
            batch = batch.select(keep)
        self.examples += len(batch)
        for block in self.blocks:
            if not all(p in batch.params for p in block.params):
                continue
            stats = self.stats[block.name]
            if isinstance(block, KronBlock):
                for rows, cols, live in block_factors(block, batch.params):
                    row_part = _kept(_second_moment(rows, block.shape[0], live, self.dtype), self.offload)
                    col_part = _kept(_second_moment(cols, block.shape[1], live, self.dtype), self.offload)
                    stats.rows = stats._add(stats.rows, row_part)
                    stats.cols = stats._add(stats.cols, col_part)
                    # on its device (read once, at the end) unless offloaded
                    stats.tokens = stats.tokens + _kept(live.sum(dtype=torch.float64), self.offload)
                stats.examples += len(batch)
            else:
                grad = _flat_grad(batch.params[block.name], self.dtype)
                part = _kept(grad.pow(2).sum(0) if block.diagonal else grad.t() @ grad, self.offload)
                stats.total = part if stats.total is None else stats.total + part
                stats.examples += len(batch)


def rotated_example_grads(block: KronBlock, grads: dict[str, ParamGradient], q_rows: Tensor | None,
                          q_cols: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[E, n_rows, n_cols]`` per-example gradients of the (bias-augmented) block in the Kronecker eigenbasis:
    ``Q_R^T G_n Q_C`` (``None`` = identity: a diagonal, one-hot side), computed in ``dtype`` (the bases are cast to
    it and moved to the factors' device)."""
    total = None
    for rows, cols, live in block_factors(block, grads):
        rot_rows = _rotate(rows, q_rows, block.shape[0], live, dtype)
        rot_cols = _rotate(cols, q_cols, block.shape[1], live, dtype)
        part = torch.einsum("etr,etc->erc", rot_rows, rot_cols)
        total = part if total is None else total + part
    return total


def _rotate(factor: Tensor, basis: Tensor | None, width: int, live: Tensor,
            dtype: torch.dtype = torch.float32) -> Tensor:
    basis = None if basis is None else basis.to(device=factor.device, dtype=dtype)  # no copy when already there
    if is_index(factor):
        ids = torch.where(live & (factor >= 0), factor, torch.full_like(factor, -1))
        hot = torch.nn.functional.one_hot(ids.clamp(min=0), width).to(dtype) * (ids >= 0).unsqueeze(-1)
        return hot if basis is None else hot @ basis
    factor = factor.to(dtype)
    return factor if basis is None else factor @ basis


class EigenCorrectionCallback(CaptureCallback):
    """EK-FAC second pass: sums of squared per-example gradients in the Kronecker eigenbasis, formed in ``dtype``
    (``FitOptions.covariance_dtype``) and kept on the CPU with ``offload``."""

    def __init__(self, blocks: list[KronBlock], bases: dict[str, tuple[Tensor | None, Tensor | None]],
                 max_bytes: int = 256 * 2**20, dtype: torch.dtype = torch.float32, offload: bool = False) -> None:
        self.blocks = blocks
        self.bases = bases
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, float] = {}
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.offload = offload
        self._placed: dict[tuple[str, torch.device], tuple[Tensor | None, Tensor | None]] = {}

    def _bases_on(self, name: str, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """The block's bases in :attr:`dtype` on ``device``, copied there once (offloaded fits keep them on the CPU)."""
        key = (name, device)
        if key not in self._placed:
            self._placed[key] = tuple(None if q is None else q.to(device=device, dtype=self.dtype)
                                      for q in self.bases[name])
        return self._placed[key]

    def on_batch(self, batch: GradientBatch, capture=None) -> None:
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            batch = batch.select((~batch.nonfinite).nonzero().flatten().tolist())
        for block in self.blocks:
            if not all(p in batch.params for p in block.params):
                continue
            q_rows, q_cols = self._bases_on(block.name, _device_of(batch.params[block.name]))
            rows, cols = block.shape
            step = max(1, self.max_bytes // (rows * cols * self.dtype.itemsize * 2))
            for start in range(0, len(batch), step):
                part = batch.select(list(range(start, min(len(batch), start + step))))
                rotated = rotated_example_grads(block, part.params, q_rows, q_cols, self.dtype)
                squares = _kept(rotated.pow(2).sum(0), self.offload)
                self.sums[block.name] = squares if block.name not in self.sums else self.sums[block.name] + squares
                self.counts[block.name] = self.counts.get(block.name, 0.0) + len(part)


def _device_of(grad: ParamGradient) -> torch.device:
    """Where a parameter's captured factors are (its first term's)."""
    term = grad.terms[0]
    return term.rows.device if isinstance(term, OuterTerm) else term.values.device
