"""Storage quantization of projected gradient rows, and a rank-correlation helper to measure its effect.

Modes:

* ``"fp32"`` -- stored as float32 (no-op for float32 input).
* ``"bf16"`` -- stored as bfloat16 (8 significant bits, float32 range).
* ``"int8"`` -- symmetric per-row absmax: ``scale = max|x_row| / 127``, ``q = round(x / scale)`` in
  ``[-127, 127]``; scales stored as float32, all-zero rows get scale 0. The absolute error of every
  entry is at most ``scale / 2 = max|x_row| / 254``.

Dequantization always returns float32, so scores are computed in float32 whatever the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MODES", "QuantizedRows", "check_scales", "quantize", "spearman"]

MODES = ("fp32", "bf16", "int8")
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class QuantizedRows:
    """Quantized rows.

    data: ``[E, D]`` stored values (float32, bfloat16 or int8 depending on ``mode``).
    scale: ``[E]`` float32 per-row scales for ``"int8"``; ``None`` for the float modes.
    mode: one of :data:`MODES`.
    """

    data: Tensor
    scale: Tensor | None
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown quantization mode {self.mode!r}; expected one of {MODES}")
        if self.data.dim() != 2 or self.data.dtype != _STORAGE[self.mode]:
            raise ValueError(f"{self.mode} rows must be a 2-D {_STORAGE[self.mode]} tensor, "
                             f"got {self.data.dtype} of shape {tuple(self.data.shape)}")
        if (self.scale is None) != (self.mode != "int8"):
            raise ValueError(f"mode {self.mode!r} {'needs' if self.mode == 'int8' else 'takes no'} per-row scales")
        if self.scale is not None and (self.scale.dtype != torch.float32 or self.scale.shape != self.data.shape[:1]):
            raise ValueError(f"int8 scales must be float32 of shape [{self.data.shape[0]}], "
                             f"got {self.scale.dtype} of shape {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        """``[E, D]``."""
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held by ``data`` and ``scale``."""
        total = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total

    def dequantize(self) -> Tensor:
        """The rows as ``[E, D]`` float32."""
        if self.scale is None:
            return self.data.to(torch.float32)
        return self.data.to(torch.float32) * self.scale.unsqueeze(1)


def quantize(x: Tensor, mode: str = "int8", *, check_finite: bool = True) -> QuantizedRows:
    """Quantize rows ``x`` (``[E, D]`` float) for storage; see the module docstring for the modes.

    Raises ``ValueError`` for ``"int8"`` when a row holds a non-finite value (it has no finite scale). That check
    reads the scales on the host; ``check_finite=False`` skips it (a non-finite row then gets a non-finite scale),
    for rows encoded on a GPU whose scales :func:`check_scales` checks once they are on the host.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; expected one of {MODES}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize expects [E, D] float rows, got {x.dtype} of shape {tuple(x.shape)}")
    if mode != "int8":
        return QuantizedRows(x.to(_STORAGE[mode]), None, mode)
    rows = x.to(torch.float32)
    if rows.shape[1] == 0:
        return QuantizedRows(rows.to(torch.int8), rows.new_zeros(rows.shape[0]), mode)
    scale = rows.abs().amax(dim=1) / 127.0  # [E]
    if check_finite:
        check_scales(scale)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    data = torch.round(rows / divisor).clamp_(-127, 127).to(torch.int8)
    return QuantizedRows(data, scale, mode)


def check_scales(scale: Tensor) -> None:
    """Raise ``ValueError`` when an int8 row's scale is not finite (its row held inf or nan)."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("int8 quantization needs finite rows; got inf or nan")


def _average_ranks(values: Tensor) -> Tensor:
    """Ranks ``0..N-1`` along the last axis of ``values`` ``[Q, N]``, ties sharing their mean rank (float64)."""
    count = values.shape[1]
    ordered, order = torch.sort(values, dim=1, stable=True)
    positions = torch.arange(count, device=values.device).expand_as(order)
    # Tie groups in sorted order: first and last position of the group each element belongs to.
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    first_pos = torch.where(new, positions, torch.zeros_like(positions)).cummax(dim=1).values
    last_pos = torch.where(last, positions, torch.full_like(positions, count)).flip(1).cummin(dim=1).values.flip(1)
    mean_rank = (first_pos + last_pos).to(torch.float64) / 2
    return torch.empty_like(mean_rank).scatter_(1, order, mean_rank)


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of matching rows, with average ranks for ties.

    a, b: ``[Q, N]`` (or ``[N]``) finite values. Returns ``[Q]`` (or a 0-d tensor) in float64; a row
    that is constant in ``a`` or ``b`` has no defined correlation and gives ``nan``.
    """
    if a.shape != b.shape or a.dim() not in (1, 2):
        raise ValueError(f"spearman expects two [Q, N] or [N] tensors of equal shape, got {a.shape} and {b.shape}")
    squeeze = a.dim() == 1
    if squeeze:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    rank_a, rank_b = _average_ranks(a), _average_ranks(b)
    rank_a = rank_a - rank_a.mean(dim=1, keepdim=True)
    rank_b = rank_b - rank_b.mean(dim=1, keepdim=True)
    corr = (rank_a * rank_b).sum(dim=1) / torch.sqrt((rank_a**2).sum(dim=1) * (rank_b**2).sum(dim=1))
    return corr[0] if squeeze else corr
