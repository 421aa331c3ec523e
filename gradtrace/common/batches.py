"""Helpers for the batches users hand to gradtrace: tensors, or dicts, lists and tuples of them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["to_device"]


def to_device(batch: Any, device: torch.device | None) -> Any:
    """``batch`` (a tensor, or dicts/lists/tuples of them) with its tensors on ``device`` (None: unchanged)."""
    if device is None:
        return batch
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
