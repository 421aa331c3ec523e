"""Attention sinks: a per-head logit ``sinks [H]`` softmaxed with each query's attention logits, then dropped
(gpt-oss's ``GptOssAttention``, and attention classes whose eager function computes the same).

For query ``q`` of head ``h`` the eager attention computes ``probs = softmax([l_1 .. l_K, s_h])`` and uses only
``p = probs[:K]`` (``o = sum_k p_k v_k``); the sink's probability ``p_s = probs[K]`` just takes mass away. With
``g_k = dL/dp_k`` (and ``dL/dp_s = 0``: the sink's column is dropped) the softmax's Jacobian gives, exactly,

    dL/ds_h  (query q)  =  p_s * (0 - sum_j p_j g_j)  =  -p_s * sum_k p_k g_k   ( = -p_s * <dL/do, o> ),

so an example's gradient of ``sinks`` is the sum over its queries of these ``[H]`` terms (the per-query summands are
its per-token terms). The handler hooks the attention weights the module returns (``scores = probs[..., :-1]``, the
tensor multiplied by the values), whose gradient is ``g``, and reads ``probs`` itself from the autograd graph: the
weights are a slice of the softmax output (its base), or a dtype cast of that slice (fp32 sinks in a bf16 model),
whose softmax node holds the output. ``p_s`` is then the softmax's own value, not ``1 - sum_k p_k``, whose
cancellation loses a small ``p_s`` (float32 keeps ``1 - sum`` to about ``1e-7`` absolute).

Before capture the module's eager attention function is run on random inputs with a copy of the module, and the
sinks' gradient autograd gives is compared with the rule; an attention that computes sinks otherwise (Granite-SWA's
post-softmax scaling) is reported, as is one whose implementation (sdpa, flash, flex) returns no probabilities and
attention dropout in training mode. Each call is checked again while running (the returned weights must be the
softmax's last-column-dropped slice); a call that is not is left uncaptured, which the capture reports.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from ...grad.terms import Term, VectorTerm
from ...projection.logra import Projector
from .base import LayerHandler, TokenScale, detached_copy, projected_vector, register_layer

__all__ = ["AttentionSinksHandler"]

_LAST = (-1, 2**64 - 1)  # a dim or slice end of -1, as autograd nodes report it (unsigned)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def softmax_probs(weights: Tensor) -> Tensor | None:
    """``probs [B, H, Q, K+1]`` when ``weights [B, H, Q, K]`` is ``probs[..., :-1]`` (or its dtype cast) for ``probs``
    a softmax over the last dim, read from the autograd graph (no host read); None otherwise."""
    return _read_softmax(weights)[0]


def _read_softmax(weights: Tensor) -> tuple[Tensor | None, str]:
    """:func:`softmax_probs` and, when None, why."""
    node, cast = weights.grad_fn, False
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        node, cast = node.next_functions[0][0], True
    not_slice = "the attention weights it returned are not the softmax probabilities with the sink's column dropped"
    if node is None or type(node).__name__ != "SliceBackward0":
        return None, not_slice
    last, width = weights.dim() - 1, weights.shape[-1]
    sizes = tuple(int(n) for n in node._saved_self_sym_sizes)
    if (node._saved_dim not in (last, *_LAST) or node._saved_start != 0 or node._saved_step != 1
            or node._saved_end not in (width, *_LAST) or sizes != (*weights.shape[:-1], width + 1)):
        return None, not_slice
    softmax = node.next_functions[0][0]
    if softmax is None or type(softmax).__name__ != "SoftmaxBackward0" or softmax._saved_dim not in (last, *_LAST):
        return None, not_slice
    if not cast:
        base = weights._base
        return (base, "") if base is not None and tuple(base.shape) == sizes else (None, not_slice)
    # a cast copy: the softmax output is its node's saved result, which is read without saved-tensor hooks only
    # (under checkpointing or save_on_cpu unpacking it here would start the recomputation)
    if _top_hooks is None or _top_hooks(False) is not None:
        return None, ("the attention weights it returned are a dtype cast of the softmax's (sinks kept in another "
                      "dtype than the model's) and saved-tensor hooks are in force (activation checkpointing, "
                      "save_on_cpu), under which the softmax's own output cannot be read in the forward pass; "
                      "give the sinks the model's dtype or turn checkpointing off")
    return softmax._saved_result, ""


def _eager_function(module: nn.Module) -> Any:
    """The ``eager_attention_forward`` of the module's modeling file (or of a base class's)."""
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(fn):
            return fn
    return None


def _probe(module: nn.Module, heads: int) -> bool:
    """On a copy with random sinks and inputs (float64, CPU), the eager function's sinks gradient equals the rule's."""
    fn = _eager_function(module)
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    head_dim = int(getattr(module, "head_dim", 0) or 0) or 4
    if fn is None or heads % groups:
        return False
    gen = torch.Generator().manual_seed(1357)
    params = {k: torch.randn(p.shape, generator=gen, dtype=torch.float64) for k, p in module._parameters.items()
              if p is not None}
    clone = detached_copy(module, params)
    clone.training = False
    sinks = clone.sinks.requires_grad_(True)
    query = torch.randn(2, heads, 3, head_dim, generator=gen, dtype=torch.float64)
    key, value = (torch.randn(2, heads // groups, 3, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    try:
        with torch.enable_grad():
            out, weights = fn(clone, query, key, value, None, scaling=head_dim**-0.5, dropout=0.0,
                              sliding_window=None, s_aux=sinks)
            probs = softmax_probs(weights) if isinstance(weights, Tensor) else None
            # the weights are that slice of the softmax output (or its dtype cast): equal bit for bit, not to a
            # tolerance
            if probs is None or not torch.equal(probs[..., :-1].to(weights.dtype), weights):
                return False
            total = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
            sinks_grad, weights_grad = torch.autograd.grad(total, [sinks, weights])
    except Exception:  # any failure means "not this computation"
        return False
    probs = probs.detach()
    rule = -(probs[..., -1] * (probs[..., :-1] * weights_grad).sum(-1)).sum((0, 2))
    return torch.allclose(sinks_grad, rule, rtol=1e-8, atol=1e-10 * float(rule.abs().max()) + 1e-12)


def _weights(output: Any) -> Tensor | None:
    """The attention weights ``[B, H, Q, K]`` of an attention module's output ``(attn_output, attn_weights)``."""
    weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
    return weights if isinstance(weights, Tensor) and weights.dim() == 4 else None


@register_layer
class AttentionSinksHandler(LayerHandler):
    """The ``sinks`` of an attention module (a 1-d ``sinks`` parameter of one logit per head, and an ``o_proj``).

    Only ``sinks`` is captured here: the module's q/k/v/o projections are modules of their own, captured as linear
    layers. Per call it keeps the attention probabilities (the softmax output autograd keeps anyway) and gets the
    gradient of the returned attention weights ``[B, H, Q, K]``.
    """

    kind = "attention_sinks"
    position_dim = 2  # attention weights [B, heads, queries, keys]: queries are the call's positions

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        sinks = module._parameters.get("sinks")
        return sinks is not None and sinks.dim() == 1 and isinstance(getattr(module, "o_proj", None), nn.Module)

    @classmethod
    def param_roles(cls, module: nn.Module) -> tuple[str, ...]:
        return ("sinks",)

    def describe(self) -> str:
        return "attention-sinks"

    def unsupported_reason(self) -> str | None:
        module = self.module
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation != "eager":
            glob = "*." + self.name.rpartition(".")[2] if self.name else self.name
            return (f"its attention implementation ({implementation!r}) returns no attention probabilities, which the "
                    "sinks' per-example rule needs: load the model with attn_implementation=\"eager\" (or call "
                    "model.set_attn_implementation(\"eager\")), or leave the sinks out: freeze them, or "
                    f"CaptureOptions(exclude=[{glob!r}]) / --exclude '{glob}' (its q/k/v/o projections stay "
                    "captured)")
        if module.training and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0:
            return ("attention dropout is active (training mode, attention_dropout > 0): the returned weights are "
                    "dropped out, not the softmax probabilities the sinks' rule needs; use attention_dropout=0 or "
                    "model.eval()")
        if not _probe(module, int(module.sinks.shape[0])):
            return ("its eager attention function does not compute the sinks as one more softmax logit per head "
                    "whose probability is dropped (checked on a copy with random sinks), so the sinks' rule does not "
                    "apply")
        return super().unsupported_reason()

    def output_tensor(self, output: Any) -> Tensor | None:
        weights = _weights(output)
        if weights is None or weights.shape[1] != self.shapes["sinks"][0] or softmax_probs(weights) is None:
            return None  # not the softmax's weights (dropout, another implementation): reported (call_unsupported)
        return weights

    def call_unsupported(self, output: Any) -> str | None:
        weights = _weights(output)
        if weights is None:
            implementation = getattr(getattr(self.module, "config", None), "_attn_implementation", None)
            return (f"the attention returned no attention weights (implementation {implementation!r} when it ran); "
                    "the sinks' rule needs them: use attn_implementation=\"eager\"")
        if weights.shape[1] != self.shapes["sinks"][0]:
            heads = self.shapes["sinks"][0]
            return f"the attention weights it returned have {weights.shape[1]} heads, its sinks {heads}"
        if self.module.training and float(getattr(self.module, "attention_dropout", 0.0) or 0.0) > 0:
            return "attention dropout is active (training mode, attention_dropout > 0)"
        return _read_softmax(weights)[1]

    def keep_call(self, inputs: Tensor, args: tuple, kwargs: dict, output: Any, projector: Projector | None) -> Any:
        return softmax_probs(output[1])  # [B, H, Q, K+1]: held by autograd already (the softmax's output)

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:  # pragma: no cover - keep_call() is used
        raise RuntimeError("AttentionSinksHandler keeps its call through keep_call()")

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        probs = saved  # [B, H, Q, K+1]
        weights_grad = grad_output.to(probs.dtype)  # [B, H, Q, K]
        mass = torch.einsum("bhqk,bhqk->bhq", probs[..., :-1], weights_grad)  # sum_k p_k g_k
        dtype = torch.promote_types(probs.dtype, torch.float32)  # float32 (float64 for a float64 model)
        values = (-(probs[..., -1] * mass)).transpose(1, 2).to(dtype)  # [B, Q, H]
        if projector is not None:
            return {"sinks": projected_vector(projector, self.params["sinks"], values, scale)}
        factor = scale(values.shape[1], values.device).to(dtype)  # [B, Q]
        return {"sinks": VectorTerm(values * factor.unsqueeze(-1))}
