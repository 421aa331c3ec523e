"""Linear layers: ``torch.nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2's transposed linear).

For tokens ``t`` of one example with inputs ``a_t`` and output-gradients ``s_t``:
``dW = sum_t s_t a_t^T`` (``[d_out, d_in]``; Conv1D stores ``W^T``, so its gradient is
``sum_t a_t s_t^T``) and ``db = sum_t s_t``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...grad.terms import OuterTerm, Term, VectorTerm
from ...projection.logra import Projector
from .base import LayerHandler, TokenScale, projected_outer, projected_vector, register_layer, scaled, tokens_last


def _is_hf_conv1d(module: nn.Module) -> bool:
    if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf


@register_layer
class LinearHandler(LayerHandler):
    """``nn.Linear`` (and subclasses) and Hugging Face ``Conv1D``."""

    kind = "linear"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.transposed = _is_hf_conv1d(module)
        rows, cols = (int(n) for n in module.weight.shape)
        self.d_in, self.d_out = (rows, cols) if self.transposed else (cols, rows)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) or _is_hf_conv1d(module)

    @property
    def activation_side(self) -> str:  # type: ignore[override]
        return "rows" if self.transposed else "cols"

    def describe(self) -> str:
        return "conv1d-hf" if self.transposed else "linear"

    def stock(self):
        if self.transposed:
            return None
        return nn.Linear, lambda gen: torch.randn(2, 3, self.d_in, generator=gen)

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        acts = tokens_last(inputs, self.d_in)  # [B, T, d_in]
        if projector is not None and "weight" in self.params:
            axis = "rows" if self.transposed else "cols"
            return projector.project(self.params["weight"], axis, acts)
        return acts

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        out_grads = tokens_last(self.rescale(grad_output), self.d_out)  # [B, T, d_out]
        # the per-token scale may go on either factor of the outer product: put it on the narrower one
        scale_acts = projector is None and "bias" not in self.params and self.d_in < self.d_out
        exact_grads = scaled(out_grads, scale) if projector is None and not scale_acts else None
        terms: dict[str, Term] = {}
        if "weight" in self.params and projector is not None:
            name = self.params["weight"]
            grads = scaled(projector.project(name, "cols" if self.transposed else "rows", out_grads), scale)
            terms["weight"] = projected_outer(projector, *((saved, grads) if self.transposed else (grads, saved)),
                                              scale)
        elif "weight" in self.params:
            grads, acts = (out_grads, scaled(saved, scale)) if scale_acts else (exact_grads, saved)
            k_g, k_a = grads.shape[-1], acts.shape[-1]
            if self.transposed:
                terms["weight"] = OuterTerm(rows=acts, cols=grads, n_rows=k_a, n_cols=k_g)
            else:
                terms["weight"] = OuterTerm(rows=grads, cols=acts, n_rows=k_g, n_cols=k_a)
        if "bias" in self.params:
            if projector is not None:
                terms["bias"] = projected_vector(projector, self.params["bias"], out_grads, scale)
            else:
                terms["bias"] = VectorTerm(exact_grads)
        return terms
