"""Gradient similarity: ``grad_dot`` and ``grad_cos`` (Pruthi et al. 2020 single checkpoint; Xia et al. 2024)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from .base import Method, register_method

__all__ = ["GradCos", "GradDot"]


@register_method
class GradDot(Method):
    """``tau(q, i) = <g_q, g_i>``: first-order change of the query loss from a gradient step on example i."""

    name = "grad_dot"
    description = "gradient inner product (positive = the training example lowers the query loss)"


def _normalize(rows: Tensor, eps: float = 1e-12) -> Tensor:
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=eps)


@register_method
class GradCos(Method):
    """``tau(q, i) = <g_q, g_i> / (|g_q| |g_i|)``: insensitive to gradient scale (long or high-loss examples)."""

    name = "grad_cos"
    description = "gradient cosine similarity in [-1, 1] (positive = helpful)"
    normalizes: ClassVar[bool] = True

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(queries)

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(block)
