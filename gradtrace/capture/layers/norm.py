"""Normalization layers with an elementwise affine: LayerNorm, RMSNorm and look-alikes.

Output ``y = xhat * (offset + w) + b`` with ``xhat`` the normalized input, so per example
``dw = sum_t s_t * xhat_t`` and ``db = sum_t s_t``. ``nn.LayerNorm`` and ``nn.RMSNorm`` are known
exactly. Other classes -- the RMSNorm variants of Hugging Face models (Llama, Qwen2, Mistral, T5,
Gemma's ``1 + w`` form, ...) and custom ones -- are recognised by structure (a module named
``*Norm*`` whose only parameters are a weight and optional bias over the last dimension) and then
*verified numerically*: the handler runs the module's own ``forward`` on a detached copy with test
weights and accepts it only if one of the known formulas reproduces the output. No manual
configuration, and no silent guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...grad.terms import Term, VectorTerm
from ...projection.logra import Projector
from .base import LayerHandler, TokenScale, detached_copy, projected_vector, register_layer, scaled

_CHANNEL_NORMS = (nn.modules.batchnorm._NormBase,)  # BatchNorm*, SyncBatchNorm, InstanceNorm*: channel dim 1
_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


@dataclass(frozen=True)
class NormFormula:
    """How a norm layer computes ``xhat``: centered ("layer") or not ("rms"), with ``eps``."""

    center: bool
    eps: float
    offset: float = 0.0  # y = xhat * (offset + w) + b

    def xhat(self, x: Tensor, width: int) -> Tensor:
        x = x.to(torch.float32)
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _eps_of(module: nn.Module) -> list[float]:
    found = [float(getattr(module, a)) for a in _EPS_ATTRS if isinstance(getattr(module, a, None), (int, float))]
    return found or [1e-6, 1e-5, 1e-12]


def _norm_like(module: nn.Module) -> bool:
    """Structural test: a ``*Norm*`` module with a 1-d weight, optional 1-d bias, nothing else."""
    if "norm" not in type(module).__name__.lower():
        return False
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or "weight" not in params:
        return False
    if any(True for _ in module.children()):
        return False
    weight, bias = params["weight"], params.get("bias")
    return weight.dim() == 1 and (bias is None or bias.shape == weight.shape)


def probe_formula(module: nn.Module) -> NormFormula | None:
    """Find the formula a norm-like module computes by running its forward on a detached copy."""
    width = int(module.weight.shape[0])
    gen = torch.Generator().manual_seed(1234)
    weight = torch.rand(width, generator=gen) + 0.5
    has_bias = getattr(module, "bias", None) is not None
    bias = torch.randn(width, generator=gen) if has_bias else None
    # test parameters and private buffers: a forward may update state in place (running statistics, counters)
    clone = detached_copy(module, {"weight": weight, **({"bias": bias} if has_bias else {})})
    x = torch.randn(2, 3, width, generator=gen) * 3 + 0.7
    try:
        with torch.no_grad():
            y = type(module).forward(clone, x)
    except Exception:
        return None
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return None
    y = y.to(torch.float32)
    for center in (False, True):
        for eps in _eps_of(module):
            for offset in (0.0, 1.0):
                formula = NormFormula(center, eps, offset)
                pred = formula.xhat(x, width) * (offset + weight)
                if has_bias:
                    pred = pred + bias
                if torch.allclose(pred, y, rtol=1e-4, atol=1e-5):
                    return formula
    return None


@register_layer
class NormHandler(LayerHandler):
    """``nn.LayerNorm``, ``nn.RMSNorm`` and verified norm-like classes (see module docstring)."""

    kind = "norm"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.formula: NormFormula | None = None
        self.native = isinstance(module, (nn.LayerNorm, nn.RMSNorm))
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            self.width = math.prod(module.normalized_shape)
        else:
            self.width = int(module.weight.shape[0])
            if not isinstance(module, _CHANNEL_NORMS):
                self.formula = probe_formula(module)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return module.weight is not None or getattr(module, "bias", None) is not None
        return _norm_like(module)

    def describe(self) -> str:
        if self.native:
            return type(self.module).__name__.lower()
        if self.formula is None:
            return "norm(unverified)"
        kind = "layernorm" if self.formula.center else "rmsnorm"
        return f"{kind}(1+w)" if self.formula.offset else kind

    def stock(self):
        if not self.native:
            return None  # verified by probe_formula instead
        stock = nn.LayerNorm if isinstance(self.module, nn.LayerNorm) else nn.RMSNorm
        return stock, lambda gen: torch.randn(2, 3, *self.module.normalized_shape, generator=gen)

    def unsupported_reason(self) -> str | None:
        if isinstance(self.module, _CHANNEL_NORMS):
            return ("batch/instance normalization has no per-example rule yet (in training mode, batch "
                    "statistics also mix the examples of a batch)")
        if not self.native and self.formula is None:
            return ("looks like a normalization layer but its output matches no known formula "
                    "(LayerNorm/RMSNorm with weight or 1+weight); register a handler for it")
        return super().unsupported_reason()

    def _xhat(self, x: Tensor) -> Tensor:
        module = self.module
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x.to(torch.float32), module.normalized_shape, None, None, module.eps)
        if isinstance(module, nn.RMSNorm):
            return F.rms_norm(x.to(torch.float32), module.normalized_shape, None, module.eps)
        return self.formula.xhat(x, self.width)

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        if inputs.dim() < 2:
            raise ValueError(f"{self.name}: expected a batched input, got shape {tuple(inputs.shape)}")
        # normalized lazily in backward: nothing is held beyond the input autograd keeps (and, under non-reentrant
        # checkpointing, recomputes: the collector keeps this through the saved-tensor hooks, capture/saved.py)
        return inputs

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        batch = grad_output.shape[0]
        terms: dict[str, Term] = {}
        out_grads = self.rescale(grad_output).reshape(batch, -1, self.width)  # [B, T, n]
        if "weight" in self.params:
            xhat = self._xhat(saved).reshape(batch, -1, self.width)
            values = out_grads.to(torch.float32) * xhat
            if grad_output.dim() > 3:  # [B, T, heads, n] (Qwen3's and OLMo-2's q/k norms): one position per token
                values = values.view(batch, grad_output.shape[1], -1, self.width).sum(2)
            terms["weight"] = (projected_vector(projector, self.params["weight"], values, scale)
                               if projector is not None else VectorTerm(scaled(values, scale)))
        if grad_output.dim() > 3:
            out_grads = out_grads.view(batch, grad_output.shape[1], -1, self.width).sum(2)
        if "bias" in self.params:
            terms["bias"] = (projected_vector(projector, self.params["bias"], out_grads, scale)
                             if projector is not None else VectorTerm(scaled(out_grads, scale)))
        return terms
