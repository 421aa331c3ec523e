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

Experts that receive no token of an example get zero. The handler recomputes ``h_p`` and ``z_p`` in the gradient
hook for the routed pairs only (the cost of the experts' own forward, not ``E`` times the tokens) and takes the
gate's vector-Jacobian product through the module's own gate (``_apply_gate``: SwiGLU, gpt-oss's clamped GLU, ...),
so the rule holds for every gate the interface allows. These two products (``W1 x``, ``W2^T dy``) are the floor of
its cost: the same work as the two weight gradients a training step computes and capture does not. Under LoGra the
factors of the tokens (``x_t``, ``g_t``) are projected once per token and then gathered per pair (``N`` rows, not
``k N``), the routing weight multiplies the projected factors (the vjp is linear), and each (row, expert) sum of outer
products is one grouped product over the pairs, which the sort by expert leaves in contiguous runs. A module whose
forward does not compute the expression above (a post-expert norm, expert parallelism, an override) is reported,
never captured wrongly: it is checked on a copy with random weights and routing before capture.

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
from ..assemble import zero_outside
from .base import LayerHandler, TokenScale, detached_copy, register_layer

__all__ = ["ExpertsHandler", "Routing", "expert_linear"]

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


def _accumulation(x: Tensor) -> torch.dtype:
    """float32 for 16- and 32-bit values, float64 for float64 ones."""
    return torch.promote_types(x.dtype, torch.float32)


def _segment_outer_sums(rows: Tensor, cols: Tensor, segment: Tensor, ends: Tensor) -> Tensor:
    """``out[s] = sum_{p in group s} rows_p (x) cols_p``: ``[S, R, C]`` (float32, or float64 for float64 factors)
    from ``[P, R]``, ``[P, C]`` whose groups are contiguous runs of pairs (group ``s`` ends at ``ends[s]``; ``segment
    [P]``: each pair's group).

    One grouped product over the pairs (``grouped_mm`` of ``rows^T`` and ``cols`` split along the pairs, as a weight
    gradient is computed; 16-bit factors multiplied into float32, which is exact) where the kernel takes the dtype and
    widths; else blocks of per-pair outer products added into their groups' rows (at most :data:`_PAIR_BLOCK` numbers
    at a time)."""
    dtype = _accumulation(rows)
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


def _blocks(values: Tensor, expert: Tensor, experts: int) -> Tensor:
    """Place per-pair vectors ``[P, n]`` in their expert's block of a ``[P, E*n]`` tensor (zeros elsewhere)."""
    dtype = _accumulation(values)
    out = values.new_zeros(values.shape[0], experts, values.shape[1], dtype=dtype)
    out.scatter_(1, expert.view(-1, 1, 1).expand(-1, 1, values.shape[1]), values.to(dtype).unsqueeze(1))
    return out.reshape(values.shape[0], -1)


def _is_experts(module: nn.Module) -> bool:
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    return (all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts"))
            and isinstance(down, Tensor) and down.dim() == 3 and isinstance(up, Tensor) and up.dim() == 3)


@register_layer
class ExpertsHandler(LayerHandler):
    """Fused experts of Hugging Face MoE models (``use_experts_implementation``): every expert's weights and biases.

    The forward call's tensors are the flattened tokens ``[B*T, ...]``; the collector hands them over as ``[B, T,
    ...]``. :meth:`keep` keeps the input and the routing; :meth:`backward` recomputes the routed pairs.
    """

    kind = "experts"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.up = "gate_up_proj" if module.has_gate else "up_proj"
        self.transposed = bool(module.is_transposed)
        self.num_experts = int(getattr(module, self.up).shape[0])

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
        routing = Routing(index, self.num_experts)
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
        """Whether the module's forward equals :meth:`_reference` on a copy with random weights and routing."""
        module = self.module
        gen = torch.Generator().manual_seed(4321)
        params = {k: torch.randn(p.shape, generator=gen) * 0.5
                  for k, p in module._parameters.items() if p is not None}
        clone = detached_copy(module, params)
        w1 = params[self.up]
        d = int(w1.shape[1] if self.transposed else w1.shape[2])
        tokens, k = 7, min(2, self.num_experts)
        x = torch.randn(tokens, d, generator=gen)
        index = torch.rand(tokens, self.num_experts, generator=gen).argsort(dim=1)[:, :k]
        weights = torch.rand(tokens, k, generator=gen)
        try:
            with torch.no_grad():
                got = type(module).forward(clone, x, index, weights)
                want = self._reference(clone, x, index, weights)
        except Exception:  # any failure means "not this computation"
            return False
        return (isinstance(got, Tensor) and got.shape == want.shape
                and torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-7))

    # -- hooks --------------------------------------------------------------------------------------------------
    def keep(self, inputs: Tensor, args: tuple, kwargs: dict, projector: Projector | None) -> Any:
        """The input ``[B, T, d]`` and the routing ``[B, T, k]`` (indices, weights) of the call."""
        bound = _bind(self.module, args, kwargs)
        index, weights = bound[1], bound[2]
        rows, tokens = inputs.shape[0], inputs.shape[1]
        return (inputs, index.detach().reshape(rows, tokens, -1), weights.detach().reshape(rows, tokens, -1))

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:  # pragma: no cover - keep() is used
        raise RuntimeError("ExpertsHandler keeps its call through keep()")

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        x, index, weights = saved  # [B, T, d], [B, T, k], [B, T, k]
        rows, tokens, k = index.shape
        module, experts = self.module, self.num_experts
        outside = getattr(scale, "outside", None)
        x, weights = zero_outside(x, outside), zero_outside(weights, outside)  # padding's NaN reaches no example
        dtype = _accumulation(grad_output)  # float32 (float64 for a float64 model)
        grads = grad_output.to(dtype) * scale(tokens, grad_output.device).unsqueeze(-1)  # [B, T, d]
        routing = Routing(index, experts)  # the pairs sorted by expert: every per-pair tensor below is in its order
        expert, token = routing.expert, routing.token
        x_tokens, g_tokens = x.reshape(rows * tokens, -1), grads.reshape(rows * tokens, -1)  # [N, d]
        w_p = weights.reshape(-1).index_select(0, routing.order).unsqueeze(1).to(dtype)  # [P, 1]
        g_p = g_tokens.index_select(0, token)  # [P, d]: g_t of each pair (dy_p = w_p g_t reaches y_p)
        if projector is None:
            g_p.mul_(w_p)  # dy_p, a factor itself; under LoGra w_p multiplies the projected factors instead
        x_p = x_tokens.index_select(0, token)  # [P, d]
        with torch.enable_grad():
            h = self._hidden(module, x_p.detach(), routing).detach().requires_grad_(True)
            z = self._gate(module, h)
        if projector is not None:
            x_p = None  # its factor is projected per token below: freed before the per-pair tensors of the gradient
        _, _, w2, _ = self._weights(module)
        # dz_p = W2[e]^T dy_p and dh_p = J^T dz_p; under LoGra without the routing weight w_p (the vjp is linear in
        # dz), which then multiplies the [P, k] projected factors, not [P, R] full-width ones
        dz = expert_linear(g_p.to(w2.dtype), w2, routing, not self.transposed)
        if projector is not None:
            g_p = None  # as x_p
        dh = torch.autograd.grad(z, h, dz.to(z.dtype))[0]
        z = z.detach()
        del h, dz

        def factor(role: str, axis: str, source: str) -> Tensor:
            """A factor of ``role``'s per-pair term, projected to ``axis`` under LoGra (float32 there). The factors
            of the tokens (``x_t``, and ``g_t`` of ``dy_p = w_p g_t``) are projected per token and then gathered
            (projection is linear): ``N`` rows projected, not ``P = k N``."""
            if projector is None:
                return {"x": x_p, "dy": g_p, "dh": dh, "z": z}[source]
            name = self.params[role]
            if source == "x":
                return projector.project(name, axis, x_tokens).index_select(0, token)
            if source == "dy":
                return projector.project(name, axis, g_tokens).index_select(0, token).mul_(w_p)
            if source == "dh":
                return projector.project(name, axis, dh).mul_(w_p)
            return projector.project(name, axis, z)

        # the factors of each parameter's per-pair outer product, in its stored layout [E, R, C]
        sources = {self.up: ("x", "dh") if self.transposed else ("dh", "x"),
                   "down_proj": ("z", "dy") if self.transposed else ("dy", "z")}
        vectors = {f"{self.up}_bias": "dh", "down_proj_bias": "dy"}
        summed = getattr(scale, "rows", None) is not None and not (projector is not None
                                                                   and projector.spec.keep_tokens)
        if summed:
            segment, ends = routing.segments(rows)  # (expert, row) groups, contiguous in the sorted order
        terms: dict[str, Term] = {}
        for role, (row_source, col_source) in sources.items():
            if role not in self.params:
                continue
            r, c = factor(role, "rows", row_source), factor(role, "cols", col_source)
            if summed:
                total = _segment_outer_sums(r, c, segment, ends)  # [E*B, R, C], expert-major
                terms[role] = VectorTerm(total.view(experts, rows, -1).transpose(0, 1).reshape(rows, 1, -1))
            else:
                terms[role] = self._slot_terms(routing.unsort(r), routing.unsort(c), routing.unsort(expert),
                                               rows, tokens, k)
        for role, source in vectors.items():
            if role not in self.params:
                continue
            v = factor(role, "vector", source)
            v = v.to(_accumulation(v))
            if summed:
                total = v.new_zeros(experts * rows, v.shape[1]).index_add_(0, segment, v)  # [E*B, n]
                terms[role] = VectorTerm(total.view(experts, rows, -1).transpose(0, 1).reshape(rows, 1, -1))
            else:
                per_pair = _blocks(routing.unsort(v), routing.unsort(expert), experts)  # [P, E*n]
                terms[role] = VectorTerm(per_pair.view(rows, tokens, k, -1).sum(2))
        return terms

    def _slot_terms(self, r: Tensor, c: Tensor, expert: Tensor, rows: int, tokens: int, k: int) -> list[Term]:
        """One per-token outer term per routing slot (pairs in token-major order): token ``t``'s slot ``j``
        contributes ``block(e, r) (x) c``."""
        blocks = _blocks(r, expert, self.num_experts).view(rows, tokens, k, -1)  # [B, T, k, E*R]
        cols = c.to(_accumulation(c)).view(rows, tokens, k, -1)
        n_rows, n_cols = blocks.shape[-1], cols.shape[-1]
        return [OuterTerm(rows=blocks[:, :, j], cols=cols[:, :, j], n_rows=n_rows, n_cols=n_cols) for j in range(k)]

    def project_full(self, projector: Projector, name: str, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Project full gradients ``[N, *shape]`` as capture does (each expert's block with the shared matrices)."""
        grads = grads.to(torch.float32)
        if len(shape) == 2:  # a bias [E, R]
            mat = projector.matrix(name, "vector", shape[1], grads.device)
            return torch.matmul(grads, mat.t()).reshape(grads.shape[0], -1)
        rows = projector.matrix(name, "rows", shape[1], grads.device)
        cols = projector.matrix(name, "cols", shape[2], grads.device)
        return torch.matmul(torch.matmul(rows, grads), cols.t()).reshape(grads.shape[0], -1)


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
