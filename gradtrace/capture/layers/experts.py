"""Fused mixture-of-experts layers: the expert weights stored as 3-D tensors (Hugging Face's experts interface).

The experts module of Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V2/V3, OLMoE and the other architectures built on
``transformers.integrations.moe.use_experts_implementation`` holds every expert's weights in one parameter
(``gate_up_proj`` ``[E, R, C]``, ``down_proj``, their biases) and is called on the flattened tokens with the routing
of each: ``experts(x [N, d], top_k_index [N, k], top_k_weights [N, k])``. For a pair ``p`` (token ``t``, one of its
``k`` slots, expert ``e``, routing weight ``w``):

    h_p = W1[e] x_t + b1[e],   z_p = gate(h_p),   y_p = W2[e] z_p + b2[e],   out_t = sum_slots w_p y_p

(``W[e] v`` is ``v @ W[e]`` for transposed layouts such as gpt-oss's.) With ``g_t`` the output gradient of token
``t``, an example's gradient of expert ``e`` sums over its pairs routed to ``e``:

    dW2[e] = sum_p (w_p g_t) (x) z_p,   db2[e] = sum_p w_p g_t,
    dW1[e] = sum_p dh_p (x) x_t,        db1[e] = sum_p dh_p,    dh_p = J_gate(h_p)^T (W2[e]^T w_p g_t)

Experts that receive no token of an example get zero. With the ``grouped_mm`` implementation (the default where the
kernel exists) nothing of the experts' forward or backward is computed again: the forward's own ``h_p`` and ``z_p``
are read where it computed them (:mod:`.experts_forward`, verified before use), the down projection's terms are
formed in the output-gradient hook, and ``dh_p`` is autograd's own gradient at ``h``, taken by a hook on it when the
backward reaches it (the up projection's terms are then delivered to the same batch: ``LaterTerm``). Where that is
not possible (another implementation; a backward that stops at the experts' output, as ``collect`` with only experts
captured asks for) the handler recomputes ``h_p`` and ``z_p`` for the routed pairs only (the cost of the experts' own
forward, not ``E`` times the tokens) and takes the gate's vector-Jacobian product through the module's own gate
(``_apply_gate``: SwiGLU, gpt-oss's clamped GLU, ...), so the rule holds for every gate the interface allows: two
products (``W1 x``, ``W2^T dy``), the work of the two weight gradients a training step computes and capture does
not. Under LoGra the factors of the tokens (``x_t``, ``g_t``) are projected once per token and then gathered per
pair (``N`` rows, not ``k N``), the routing weight multiplies the projected factors (the vjp is linear), and each
(row, expert) sum of outer products is one grouped product over the pairs, which the sort by expert leaves in
contiguous runs. A module whose forward does not compute the expression above (a post-expert norm, expert
parallelism, an override) is reported, never captured wrongly: it is checked on a copy with random weights and
routing before capture.

Layout of the captured gradient: a parameter ``[E, R, C]`` is the matrix ``[E*R, C]`` (expert-major, as it is
stored), a bias ``[E, R]`` the vector ``[E*R]``. Under LoGra each expert's block is projected with the parameter's
two matrices (``R -> k_rows``, ``C -> k_cols``, shared by its experts): ``[E*k_rows, k_cols]`` per example, each
block a LoGra sketch of that expert's gradient. Rows whose tokens are all one example's (not packed) are summed in
the hook into one ``[E*R*C]`` (or ``[E*k_rows*k_cols]``) vector per row; packed rows and kept tokens get per-token
terms, one per routing slot.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ...grad.terms import OuterTerm, Term, VectorTerm
from ...projection.logra import Projector
from ..assemble import LaterTerm, zero_outside
from .base import LayerHandler, TokenScale, detached_copy, register_layer
from .experts_forward import GroupedForward, pair_positions
from .experts_ops import Routing, accumulation, blocks, expert_linear, segment_outer_sums

__all__ = ["ExpertsHandler", "Routing", "expert_linear"]

_PROBE_EXPERTS = 4
"""Experts of the copy the probe runs (the module's first ones): its random weights cost ``4 / E`` of the module's
(a Qwen3-30B-A3B layer's 604M numbers would be 19M). A module that fails there is probed again at full size."""


def _is_experts(module: nn.Module) -> bool:
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    return (all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts"))
            and isinstance(down, Tensor) and down.dim() == 3 and isinstance(up, Tensor) and up.dim() == 3)


@register_layer
class ExpertsHandler(LayerHandler):
    """Fused experts of Hugging Face MoE models (``use_experts_implementation``): every expert's weights and biases.

    The forward call's tensors are the flattened tokens ``[B*T, ...]``; the collector hands them over as ``[B, T,
    ...]``. :meth:`keep` keeps the input, the routing and what the forward computed where it was watched;
    :meth:`backward` forms the terms (see the module docstring).
    """

    kind = "experts"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.up = "gate_up_proj" if module.has_gate else "up_proj"
        self.transposed = bool(module.is_transposed)
        self.num_experts = int(getattr(module, self.up).shape[0])
        self._reuse: tuple[Any, int] | None = None  # (implementation, h's in-place changes): the probe's watch held
        self._watch: GroupedForward | None = None

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return _is_experts(module)

    @classmethod
    def param_roles(cls, module: nn.Module) -> tuple[str, ...]:
        return ("gate_up_proj", "gate_up_proj_bias", "up_proj", "up_proj_bias", "down_proj", "down_proj_bias")

    def describe(self) -> str:
        return f"experts({self.num_experts})"

    # -- what the module computes -------------------------------------------------------------------------------
    def _weights(self, module: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        up_bias = getattr(module, f"{self.up}_bias", None) if getattr(module, "has_bias", False) else None
        down_bias = getattr(module, "down_proj_bias", None) if getattr(module, "has_bias", False) else None
        return getattr(module, self.up), up_bias, module.down_proj, down_bias

    def _gate(self, module: nn.Module, h: Tensor) -> Tensor:
        return module._apply_gate(h) if module.has_gate else module.act_fn(h)

    def _hidden(self, module: nn.Module, x: Tensor, routing: Routing) -> Tensor:
        """``h_i = W1[e_i] x_i + b1[e_i]`` of routed pairs ``x`` ``[P, d]`` (``routing``'s order)."""
        w1, b1, _, _ = self._weights(module)
        h = expert_linear(x, w1, routing, self.transposed)
        return h if b1 is None else h + b1.index_select(0, routing.expert).to(h.dtype)

    def _reference(self, module: nn.Module, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """The experts' output ``[N, d]`` by the expression of the module docstring (the rule's own forward)."""
        routing = Routing(index, int(getattr(module, self.up).shape[0]))
        z = self._gate(module, self._hidden(module, x.index_select(0, routing.token), routing))
        _, _, w2, b2 = self._weights(module)
        y = expert_linear(z, w2, routing, self.transposed)
        if b2 is not None:
            y = y + b2.index_select(0, routing.expert).to(y.dtype)
        y = routing.unsort(y * weights.reshape(-1).index_select(0, routing.order).unsqueeze(1).to(y.dtype))
        return y.view(-1, routing.k, y.shape[-1]).sum(1)

    def unsupported_reason(self) -> str | None:
        module = self.module
        if getattr(module, "has_post_expert_norm", False):
            return "its experts apply a norm after the down projection, which this rule does not cover"
        if getattr(module, "_is_expert_parallel", False):
            return "its experts are sharded across ranks (expert parallelism), which this rule does not cover"
        if not hasattr(module, "_apply_gate" if module.has_gate else "act_fn"):
            return "it has no gate function (_apply_gate / act_fn) to differentiate"
        if not self._probe():
            return ("its forward does not compute the standard experts expression (routed tokens through W1, the "
                    "gate, W2, weighted by the routing weights and summed), checked on a copy with random weights")
        return None

    def _probe(self) -> bool:
        """Whether the module's forward equals :meth:`_reference` on a copy with random weights and routing (its first
        :data:`_PROBE_EXPERTS` experts; all of them where that fails). Sets whether the forward's own hidden values
        can be read (:mod:`.experts_forward`)."""
        return self._probe_with(min(self.num_experts, _PROBE_EXPERTS)) or (
            self.num_experts > _PROBE_EXPERTS and self._probe_with(self.num_experts))

    def _probe_with(self, experts: int) -> bool:
        """:meth:`_probe` on a copy of the module's first ``experts`` experts."""
        module = self.module
        gen = torch.Generator().manual_seed(4321)
        params = {k: torch.randn((experts, *p.shape[1:]) if p.shape[:1] == (self.num_experts,) else p.shape,
                                 generator=gen) * 0.5
                  for k, p in module._parameters.items() if p is not None}
        clone = detached_copy(module, params)
        clone.num_experts = experts
        w1, _, w2, _ = self._weights(clone)
        d = int(w1.shape[1] if self.transposed else w1.shape[2])
        tokens, k = 7, min(2, experts)
        x = torch.randn(tokens, d, generator=gen)
        index = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :k].contiguous()  # as topk returns it
        weights = torch.rand(tokens, k, generator=gen)
        try:
            with torch.no_grad():
                with GroupedForward(index, w1, w2) as watch:
                    got = type(module).forward(clone, x, index, weights)
                want = self._reference(clone, x, index, weights)
        except Exception:  # any failure means "not this computation"
            return False
        if not (isinstance(got, Tensor) and got.shape == want.shape and _close(got, want)):
            return False
        self._reuse = None
        h_version = int(self._weights(module)[1] is not None)  # its bias added in place, nothing else (a gate's own
        read = watch.values(tokens * k, h_version)  # in-place change of h, a clamp, would make h not the forward's)
        if read is not None:
            routing = Routing(index, experts)
            with torch.no_grad():
                at = pair_positions(read[0], routing.order)
                h, z = read[1].index_select(0, at), read[2].index_select(0, at)
                want_h = self._hidden(clone, x.index_select(0, routing.token), routing)
                want_z = self._gate(clone, want_h)
                if h.shape == want_h.shape and z.shape == want_z.shape and _close(h, want_h) and _close(z, want_z):
                    self._reuse = (_implementation(module), h_version)
        return True

    # -- hooks --------------------------------------------------------------------------------------------------
    def keep(self, inputs: Tensor, args: tuple, kwargs: dict, projector: Projector | None) -> Any:
        """The input ``[B, T, d]`` and the routing ``[B, T, k]`` (indices, weights) of the call; where the forward
        was watched (:meth:`watch_forward`), also its ``(perm, h, z)`` and the :class:`_Later` that takes the gradient
        of its ``h`` when autograd computes it."""
        bound = _bind(self.module, args, kwargs)
        index, weights = bound[1], bound[2]
        rows, tokens = inputs.shape[0], inputs.shape[1]
        watch, self._watch = self._watch, None
        read = later = node = None
        if watch is not None and watch.index is index and self._reuse is not None:
            read = watch.values(index.numel(), self._reuse[1])
        if read is not None:
            perm, h, z = read
            if h.requires_grad and h.grad_fn is not None:
                later, node = _Later(), h.grad_fn  # the node is kept here, not by the hook: no reference cycle
                h.register_hook(later.on_grad)
            read = (perm, h.detach(), z.detach())
        return (inputs, index.detach().reshape(rows, tokens, -1), weights.detach().reshape(rows, tokens, -1),
                read, later, node)

    def watch_forward(self, args: tuple, kwargs: dict) -> GroupedForward | None:
        """A watch of this call's forward, where the probe found its hidden values readable (see :meth:`keep`)."""
        self._watch = None
        if self._reuse is None or _implementation(self.module) != self._reuse[0]:
            return None
        w1, _, w2, _ = self._weights(self.module)
        self._watch = GroupedForward(_bind(self.module, args, kwargs)[1], w1, w2)
        return self._watch

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:  # pragma: no cover - keep() is used
        raise RuntimeError("ExpertsHandler keeps its call through keep()")

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Any]:
        x, index, weights, read, later, node = saved  # [B, T, d], [B, T, k], [B, T, k]; the forward's or None
        call = _Call(self, x, index, weights, grad_output, scale, projector)
        routing, module = call.routing, self.module
        at = None if read is None else pair_positions(read[0], routing.order)
        up = [r for r in (self.up, f"{self.up}_bias") if r in self.params]
        if at is not None and later is not None and up and _will_run(node):
            # the forward's z, and dh from autograd's own backward through the gate and W2 (the h hook): nothing of
            # the experts' forward or backward is computed again
            z = call.clean(read[2].index_select(0, at))
            terms: dict[str, Any] = self._terms(call, {"z": z}, exclude=up)
            call.g_tokens = None  # the rest needs only dh
            pending = {role: LaterTerm(self.params[role]) for role in up}  # named by its parameter
            later.pending = lambda grad: _deliver(self._terms(call, {"dh": call.graph_dh(grad, at)}, only=up),
                                                  pending)
            return {**terms, **pending}
        with torch.enable_grad():
            # the forward's h_p where it was read (no W1 x again), else recomputed for the routed pairs
            h = (call.clean(read[1].index_select(0, at)) if at is not None
                 else self._hidden(module, call.x_pairs(), routing))
            h = h.detach().requires_grad_(True)
            z = self._gate(module, h)
        if projector is not None:
            call._x_pairs = None  # LoGra projects x per token: freed before the per-pair tensors of the gradient
        _, _, w2, _ = self._weights(module)
        # dz_p = W2[e]^T dy_p and dh_p = J^T dz_p; under LoGra without the routing weight w_p (the vjp is linear in
        # dz), which then multiplies the [P, k] projected factors, not [P, R] full-width ones
        dz = expert_linear(call.g_pairs().to(w2.dtype), w2, routing, not self.transposed)
        dh = torch.autograd.grad(z, h, dz.to(z.dtype))[0]
        del h, dz
        if projector is None:
            dh = dh * call.w_p
        return self._terms(call, {"z": z.detach(), "dh": dh, "dh_unweighted": projector is not None})

    def _terms(self, call: _Call, values: dict[str, Any], only: list[str] | None = None,
               exclude: list[str] = ()) -> dict[str, Term]:
        """The terms of the roles in ``only`` (all but ``exclude``) from the per-pair ``values`` (``z``, ``dh`` in
        the routing's order) and the call's tokens."""
        projector, routing, params = call.projector, call.routing, self.params
        token, rows, experts = routing.token, call.rows, self.num_experts

        def factor(role: str, axis: str, source: str) -> Tensor:
            """A factor of ``role``'s per-pair term, projected to ``axis`` under LoGra (float32 there). The factors
            of the tokens (``x_t``, and ``g_t`` of ``dy_p = w_p g_t``) are projected per token and then gathered
            (projection is linear): ``N`` rows projected, not ``P = k N``."""
            if source == "dy":
                if projector is None:
                    return call.g_pairs() * call.w_p
                return projector.project(params[role], axis, call.g_tokens).index_select(0, token).mul_(call.w_p)
            if source == "x":
                if projector is None:
                    return call.x_pairs()
                return projector.project(params[role], axis, call.x_tokens).index_select(0, token)
            value = values[source]
            if projector is None:
                return value
            out = projector.project(params[role], axis, value)
            return out.mul_(call.w_p) if source == "dh" and values.get("dh_unweighted") else out

        # the factors of each parameter's per-pair outer product, in its stored layout [E, R, C]
        sources = {self.up: ("x", "dh") if self.transposed else ("dh", "x"),
                   "down_proj": ("z", "dy") if self.transposed else ("dy", "z")}
        vectors = {f"{self.up}_bias": "dh", "down_proj_bias": "dy"}
        wanted = [r for r in params if (only is None or r in only) and r not in exclude]
        terms: dict[str, Term] = {}
        for role in wanted:
            if role in sources:
                r, c = (factor(role, axis, source) for axis, source in zip(("rows", "cols"), sources[role]))
                if call.summed:
                    total = segment_outer_sums(r, c, call.segment, call.ends)  # [E*B, R, C], expert-major
                    terms[role] = VectorTerm(total.view(experts, rows, -1).transpose(0, 1).reshape(rows, 1, -1))
                else:
                    terms[role] = self._slot_terms(routing.unsort(r), routing.unsort(c), routing.unsort(routing.expert),
                                                   rows, call.tokens, routing.k)
            elif role in vectors:
                v = factor(role, "vector", vectors[role])
                v = v.to(accumulation(v))
                if call.summed:
                    total = v.new_zeros(experts * rows, v.shape[1]).index_add_(0, call.segment, v)  # [E*B, n]
                    terms[role] = VectorTerm(total.view(experts, rows, -1).transpose(0, 1).reshape(rows, 1, -1))
                else:
                    per_pair = blocks(routing.unsort(v), routing.unsort(routing.expert), experts)  # [P, E*n]
                    terms[role] = VectorTerm(per_pair.view(rows, call.tokens, routing.k, -1).sum(2))
        return terms

    def _slot_terms(self, r: Tensor, c: Tensor, expert: Tensor, rows: int, tokens: int, k: int) -> list[Term]:
        """One per-token outer term per routing slot (pairs in token-major order): token ``t``'s slot ``j``
        contributes ``block(e, r) (x) c``."""
        placed = blocks(r, expert, self.num_experts).view(rows, tokens, k, -1)  # [B, T, k, E*R]
        cols = c.to(accumulation(c)).view(rows, tokens, k, -1)
        n_rows, n_cols = placed.shape[-1], cols.shape[-1]
        return [OuterTerm(rows=placed[:, :, j], cols=cols[:, :, j], n_rows=n_rows, n_cols=n_cols) for j in range(k)]

    def project_full(self, projector: Projector, name: str, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Project full gradients ``[N, *shape]`` as capture does (each expert's block with the shared matrices)."""
        grads = grads.to(torch.float32)
        if len(shape) == 2:  # a bias [E, R]
            mat = projector.matrix(name, "vector", shape[1], grads.device)
            return torch.matmul(grads, mat.t()).reshape(grads.shape[0], -1)
        rows = projector.matrix(name, "rows", shape[1], grads.device)
        cols = projector.matrix(name, "cols", shape[2], grads.device)
        return torch.matmul(torch.matmul(rows, grads), cols.t()).reshape(grads.shape[0], -1)


class _Call:
    """One experts call in backward: its routing (the pairs sorted by expert: every per-pair tensor is in its order),
    its tokens' inputs and output gradients (the loss scale applied; padding's NaN zeroed) and routing weights."""

    def __init__(self, handler: ExpertsHandler, x: Tensor, index: Tensor, weights: Tensor, grad_output: Tensor,
                 scale: TokenScale, projector: Projector | None) -> None:
        rows, tokens, _ = index.shape
        self.rows, self.tokens, self.projector = rows, tokens, projector
        self.outside = getattr(scale, "outside", None)
        x, weights = zero_outside(x, self.outside), zero_outside(weights, self.outside)
        self.dtype = accumulation(grad_output)  # float32 (float64 for a float64 model)
        self.token_scale = scale(tokens, grad_output.device)  # [B, T]
        grads = grad_output.to(self.dtype) * self.token_scale.unsqueeze(-1)  # [B, T, d]
        self.routing = routing = Routing(index, handler.num_experts)
        self.x_tokens, self.g_tokens = x.reshape(rows * tokens, -1), grads.reshape(rows * tokens, -1)  # [N, d]
        self.w_p = weights.reshape(-1).index_select(0, routing.order).unsqueeze(1).to(self.dtype)  # [P, 1]
        self.summed = getattr(scale, "rows", None) is not None and not (projector is not None
                                                                        and projector.spec.keep_tokens)
        if self.summed:
            self.segment, self.ends = routing.segments(rows)  # (expert, row) groups, contiguous in the sorted order
        self._g_pairs: Tensor | None = None
        self._x_pairs: Tensor | None = None

    def x_pairs(self) -> Tensor:
        """``[P, d]``: ``x_t`` of each pair, formed once (the recomputed ``W1 x`` and the exact factors share it)."""
        if self._x_pairs is None:
            self._x_pairs = self.x_tokens.index_select(0, self.routing.token)
        return self._x_pairs

    def g_pairs(self) -> Tensor:
        """``[P, d]``: ``g_t`` of each pair (``dy_p = w_p g_t`` reaches ``y_p``), formed once."""
        if self._g_pairs is None:
            self._g_pairs = self.g_tokens.index_select(0, self.routing.token)
        return self._g_pairs

    def clean(self, values: Tensor) -> Tensor:
        """Per-pair ``values`` with the non-finite pairs of padding's tokens set to 0, as padding's input is."""
        if self.outside is None:
            return values
        bad = self.outside.reshape(-1).index_select(0, self.routing.token) & ~torch.isfinite(values.sum(1))
        return values.masked_fill(bad.unsqueeze(1), 0.0)

    def graph_dh(self, grad: Tensor, at: Tensor) -> Tensor:
        """``dh_p`` (routing weight included) from the gradient autograd gave the forward's ``h`` (its order: ``at``
        maps it to the routing's), with the loss scale of each pair's token."""
        pair_scale = self.token_scale.reshape(-1).index_select(0, self.routing.token).unsqueeze(1).to(self.dtype)
        return self.clean(grad.index_select(0, at).to(self.dtype).mul_(pair_scale))


class _Later:
    """Takes the gradient of one call's forward ``h`` when autograd computes it, for what the call's output-gradient
    hook left :attr:`pending` (the gate and up-projection terms). Holds no graph node (no reference cycle)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: Any = None

    def on_grad(self, grad: Tensor) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending(grad)


def _will_run(node: Any) -> bool:
    """Whether this backward pass computes the gradient at ``node`` (a ``torch.autograd.grad`` to outputs above it
    does not)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return False


def _deliver(terms: dict[str, Term], pending: dict[str, LaterTerm]) -> None:
    for role, term in terms.items():
        pending[role].deliver(term)


def _close(got: Tensor, want: Tensor) -> bool:
    return torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-7)


def _implementation(module: nn.Module) -> Any:
    """The experts implementation the module's config names (None without one)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """``(hidden_states, top_k_index, top_k_weights)`` of an experts call, by position or by name."""
    if len(args) >= 3 and not kwargs:
        return list(args[:3])
    forward = inspect.unwrap(type(module).forward)
    names = [p for p in inspect.signature(forward).parameters if p != "self"][:3]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"gradtrace: the experts call has no {', '.join(missing)} argument")
    return [values[n] for n in names]
