"""Mixture-of-experts routers: a ``weight`` ``[E, d]`` (and bias) applied as a linear map to the tokens.

A router (Qwen3-MoE's ``Qwen3MoeTopKRouter``, Mixtral's, gpt-oss's, DeepSeek-V3's ``TopkRouter``, ...) computes
``logits = x W^T (+ b)`` for the flattened tokens and returns them with the routing it derives from them (softmax or
sigmoid, top-k, normalisation, group limits). Whatever the derivation, the weight's gradient is the linear layer's,
``dW = sum_t s_t x_t^T`` with ``s_t`` the gradient of token ``t``'s logits -- the total one, through the routing
weights the experts used and through any auxiliary loss. The handler hooks the logits the router returns (the same
tensor its routing was computed from), so ``s_t`` is that total; the rule is checked on a copy of the router with
random weights (the logits equal the linear map, and the weight's gradient equals the rule's) before capture, and a
router computing anything else is reported, not captured.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import detached_copy, register_layer
from .linear import LinearHandler

__all__ = ["RouterHandler"]


def _logits(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


@register_layer
class RouterHandler(LinearHandler):
    """The router of a mixture-of-experts block (a module with ``top_k``, ``num_experts`` and a ``[E, d]`` weight)."""

    kind = "router"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.transposed = False
        self.d_out, self.d_in = (int(n) for n in module.weight.shape)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return (not isinstance(module, nn.Linear) and hasattr(module, "top_k") and hasattr(module, "num_experts")
                and isinstance(weight, nn.Parameter) and weight.dim() == 2
                and weight.shape[0] == module.num_experts)

    @property
    def activation_side(self) -> str:  # type: ignore[override]
        return "cols"

    def describe(self) -> str:
        return "router"

    def stock(self):
        return None

    def output_tensor(self, output: Any) -> Tensor | None:
        return _logits(output)

    def unsupported_reason(self) -> str | None:
        if not self._probe():
            return ("its forward does not return the linear map of its input (x W^T + b) as the logits its routing is "
                    "computed from (checked on a copy with random weights), so the linear rule does not apply")
        return None

    def _probe(self) -> bool:
        """On a copy with random weights: the returned logits equal ``x W^T + b`` and the weight's gradient through
        every output equals ``sum_t s_t x_t^T`` with ``s_t`` the logits' gradient."""
        module = self.module
        gen = torch.Generator().manual_seed(2468)
        params = {k: torch.randn(p.shape, generator=gen) for k, p in module._parameters.items() if p is not None}
        clone = detached_copy(module, params)
        for p in clone._parameters.values():
            p.requires_grad_(True)
        x = torch.randn(2, 3, self.d_in, generator=gen)
        seen: list[Tensor] = []
        try:
            with torch.enable_grad():
                out = type(module).forward(clone, x)
                logits = _logits(out)
                if logits is None or logits.numel() != 6 * self.d_out:
                    return False
                logits.register_hook(lambda g: seen.append(g))
                want = F.linear(x.reshape(-1, self.d_in), params["weight"], params.get("bias"))
                if not torch.allclose(logits.detach().float().reshape(-1, self.d_out), want, rtol=1e-4, atol=1e-4):
                    return False
                outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                           if isinstance(o, Tensor) and o.is_floating_point() and o.requires_grad]
                total = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outputs)
                weight_grad = torch.autograd.grad(total, clone.weight)[0]
        except Exception:  # any failure means "not this computation"
            return False
        if len(seen) != 1:
            return False
        s = seen[0].float().reshape(-1, self.d_out)
        rule = s.t() @ x.reshape(-1, self.d_in)
        return torch.allclose(weight_grad.float(), rule, rtol=1e-4, atol=1e-4 * float(rule.abs().max()) + 1e-6)
