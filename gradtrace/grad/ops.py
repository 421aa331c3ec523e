"""Operations on per-example gradients: inner products, norms, per-token decomposition, concat, casts.

Every operation works parameter by parameter on :class:`GradientBatch` terms and routes each parameter to the
cheaper exact computation -- factorized ("ghost") or materialized -- as chosen by the cost model
(:mod:`gradtrace.grad.cost`); ``route=`` pins one. All routes return the same numbers (float32
accumulation), up to rounding.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cost import CostModel, TermShape, default_cost_model
from .ghost import DEFAULT_MAX_BYTES, ghost_diag, ghost_inner
from .terms import DenseTerm, OuterTerm, Term, VectorTerm, cat_terms, is_index

if TYPE_CHECKING:  # ops need only the batch's fields: batch.py calls into ops, not the other way
    from .batch import GradientBatch, ParamGradient

__all__ = ["check_compatible", "concat", "dense_inner", "inner", "param_route", "sq_norms", "to", "token_inner",
           "weighted_sum"]


class IncompatibleGradients(ValueError):
    """Two gradient batches cannot be combined (different layers, projections, shapes or dtypes)."""


def _float_dtypes(pg: ParamGradient) -> tuple[str, ...]:
    dtypes = set()
    for term in pg.terms:
        for f in dataclasses.fields(term):
            value = getattr(term, f.name)
            if isinstance(value, Tensor) and value.is_floating_point():
                dtypes.add(str(value.dtype).replace("torch.", ""))
    return tuple(sorted(dtypes))


def check_compatible(a: GradientBatch, b: GradientBatch, what: str = "this operation") -> None:
    """Raise :class:`IncompatibleGradients` naming the first difference that makes ``a`` and ``b``
    incomparable: parameter sets, projection spec, per-parameter shapes or dtypes."""
    if list(a.params) != list(b.params):
        only_a = [n for n in a.params if n not in b.params]
        only_b = [n for n in b.params if n not in a.params]
        detail = (f"only in the first: {only_a[:5]}" if only_a else "") + (
            f"{'; ' if only_a else ''}only in the second: {only_b[:5]}" if only_b else "")
        raise IncompatibleGradients(f"{what}: the gradients cover different parameters ({detail or 'order differs'})")
    if a.projection != b.projection:
        raise IncompatibleGradients(f"{what}: different projections: {a.projection} vs {b.projection}")
    for name, pa in a.params.items():
        pb = b.params[name]
        if pa.shape != pb.shape:
            raise IncompatibleGradients(f"{what}: {name} has shape {pa.shape} vs {pb.shape}")
        da, db = _float_dtypes(pa), _float_dtypes(pb)
        if da != db:
            raise IncompatibleGradients(f"{what}: {name} is stored as {da} vs {db}; cast one side with .to(dtype=...)")


def _warn_nonfinite(batch: GradientBatch) -> None:
    if batch.nonfinite is not None and bool(batch.nonfinite.any()):
        bad = [batch.ids[i] for i in batch.nonfinite.nonzero().flatten().tolist()]
        warnings.warn(f"gradtrace: {len(bad)} example(s) with NaN/inf gradients take part: {bad[:5]}", stacklevel=3)


def _shapes(pg: ParamGradient) -> list[TermShape]:
    return [TermShape.of(t) for t in pg.terms]


def param_route(pa: ParamGradient, pb: ParamGradient, route: str = "auto", max_bytes: int = DEFAULT_MAX_BYTES,
                cost_model: CostModel | None = None) -> str:
    """The route used for one parameter's inner products (``route`` unless it is ``"auto"``)."""
    if route not in ("auto", "ghost", "materialize"):
        raise ValueError(f"route must be 'auto', 'ghost' or 'materialize', got {route!r}")
    has_ghost = any(isinstance(x, OuterTerm) and isinstance(y, OuterTerm) for x in pa.terms for y in pb.terms)
    if route == "ghost" and not has_ghost:
        return "materialize"  # nothing factorized on both sides: the two routes coincide
    if route != "auto":
        return route
    return (cost_model or default_cost_model()).choose_param_inner(_shapes(pa), _shapes(pb), max_bytes)


def _chunk(count: int, row_bytes: int, max_bytes: int) -> int:
    return max(1, min(count, max_bytes // max(1, row_bytes)))


def _row_step(pg: ParamGradient, examples: int, max_bytes: int) -> int:
    """Rows of the gradient matrix per block so that ``examples`` materialized blocks fit ``max_bytes``."""
    cols = max(1, pg.numel // pg.num_rows)
    return max(1, min(pg.num_rows, max_bytes // max(1, examples * cols * 4)))


def _materialized_inner(pa: ParamGradient, pb: ParamGradient, max_bytes: int) -> Tensor:
    """``[E1, E2]`` by materializing both sides block by block of gradient rows (each entry formed once)."""
    step = _row_step(pa, pa.num_examples + pb.num_examples, max_bytes)
    out = None
    for r0 in range(0, pa.num_rows, step):
        r1 = min(pa.num_rows, r0 + step)
        part = pa.flat_rows(r0, r1) @ pb.flat_rows(r0, r1).t()
        out = part if out is None else out.add_(part)
    return out


def _take(pg: ParamGradient, start: int, stop: int) -> ParamGradient:
    return pg.map_examples(lambda x: x[start:stop])


def _device(pg: ParamGradient) -> torch.device:
    term = pg.terms[0]
    return (term.rows if isinstance(term, OuterTerm) else term.values).device


def _term_flat(term: Term) -> Tensor:
    return term.materialize().reshape(term.num_examples, -1)


def _sum_term_pairs(terms_a: list[Term], terms_b: list[Term], ghost: Callable[[OuterTerm, OuterTerm], Tensor],
                    flat: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """A bilinear form of two parameter gradients, summed over every pair of their terms: ``ghost(ta, tb)`` when
    both are outer terms (never materialized), else ``flat`` of the two flattened terms (``[E, n]`` each)."""
    total = None
    for ta in terms_a:
        for tb in terms_b:
            if isinstance(ta, OuterTerm) and isinstance(tb, OuterTerm):
                part = ghost(ta, tb)
            else:
                part = flat(_term_flat(ta), _term_flat(tb))
            total = part if total is None else total + part
    return total


def param_inner(pa: ParamGradient, pb: ParamGradient, route: str = "auto", max_bytes: int = DEFAULT_MAX_BYTES,
                cost_model: CostModel | None = None) -> Tensor:
    """``[E1, E2]`` inner products of one parameter's per-example gradients."""
    chosen = param_route(pa, pb, route, max_bytes, cost_model)
    if chosen == "materialize":
        return _materialized_inner(pa, pb, max_bytes)
    return _sum_term_pairs(pa.terms, pb.terms, lambda ta, tb: ghost_inner(ta, tb, max_bytes=max_bytes),
                           lambda flat_a, flat_b: flat_a @ flat_b.t())


def inner(a: GradientBatch, b: GradientBatch, *, per_param: bool = False, route: str = "auto",
          max_bytes: int = DEFAULT_MAX_BYTES, cost_model: CostModel | None = None) -> Tensor | dict[str, Tensor]:
    """Inner products of every example of ``a`` with every example of ``b``.

    Returns ``[E1, E2]`` summed over parameters, or ``{name: [E1, E2]}`` with ``per_param=True``.
    ``route``: ``"auto"`` (cost model, per parameter), ``"ghost"`` or ``"materialize"``; ``max_bytes``
    bounds the temporaries of either route.
    """
    check_compatible(a, b, "inner product")
    _warn_nonfinite(a)
    if b is not a:
        _warn_nonfinite(b)
    out = {name: param_inner(pa, b.params[name], route, max_bytes, cost_model) for name, pa in a.params.items()}
    return out if per_param else sum(out.values())


def param_sq_norms(pg: ParamGradient, route: str = "auto", max_bytes: int = DEFAULT_MAX_BYTES,
                   cost_model: CostModel | None = None) -> Tensor:
    """``[E]`` squared norms of one parameter's per-example gradients."""
    outer = [t for t in pg.terms if isinstance(t, OuterTerm)]
    if route == "auto":
        if outer:
            model = cost_model or default_cost_model()
            ghost = sum(min(c.seconds(model.profile) for c in model.norm_costs(TermShape.of(t), max_bytes)
                            if c.route == "ghost") for t in outer)
            mat = sum(min(c.seconds(model.profile) for c in model.norm_costs(TermShape.of(t), max_bytes)
                          if c.route == "materialize") for t in outer)
            route = "ghost" if ghost < mat else "materialize"
        else:
            route = "materialize"
    if route == "materialize" or not outer:
        step = _row_step(pg, pg.num_examples, max_bytes)
        return sum(pg.flat_rows(r0, min(pg.num_rows, r0 + step)).pow(2).sum(1) for r0 in range(0, pg.num_rows, step))
    if route != "ghost":
        raise ValueError(f"route must be 'auto', 'ghost' or 'materialize', got {route!r}")
    return _sum_term_pairs(pg.terms, pg.terms, lambda ta, tb: ghost_diag(ta, tb, max_bytes=max_bytes),
                           lambda flat_a, flat_b: (flat_a * flat_b).sum(1))


def sq_norms(a: GradientBatch, *, per_param: bool = False, route: str = "auto", max_bytes: int = DEFAULT_MAX_BYTES,
             cost_model: CostModel | None = None) -> Tensor | dict[str, Tensor]:
    """Squared norms of each example's gradient: ``[E]`` (or ``{name: [E]}`` with ``per_param=True``)."""
    _warn_nonfinite(a)
    out = {name: param_sq_norms(pg, route, max_bytes, cost_model) for name, pg in a.params.items()}
    return out if per_param else sum(out.values())


def _token_part(ta: Term, pb: ParamGradient, max_bytes: int) -> Tensor:
    """``[E1, T_a, E2]``: each token of ``ta``'s examples against ``pb``'s whole per-example gradients."""
    if isinstance(ta, DenseTerm):
        raise ValueError("the first gradients were summed over tokens (a projected or reduced batch): no per-token "
                         "decomposition; capture with LoGra(keep_tokens=True) or without projection")
    total = None
    for tb in pb.terms:
        if isinstance(ta, OuterTerm) and isinstance(tb, OuterTerm):
            part = ghost_inner(ta, tb, per_token=True, max_bytes=max_bytes)
        elif isinstance(ta, VectorTerm):
            part = torch.einsum("etn,fn->etf", ta.values.to(torch.float32), _term_flat(tb))
        else:  # outer token factors against a materialized matrix: r_t^T H_j c_t, chunked over j
            part = _bilinear_tokens(ta, tb.materialize().reshape(tb.num_examples, ta.n_rows, ta.n_cols), max_bytes)
        total = part if total is None else total + part
    return total


def _bilinear_tokens(ta: OuterTerm, mats: Tensor, max_bytes: int) -> Tensor:
    rows = _dense_factor(ta.rows, ta.n_rows)
    cols = _dense_factor(ta.cols, ta.n_cols)
    e1, t = rows.shape[:2]
    step = _chunk(mats.shape[0], e1 * t * ta.n_cols * 4, max_bytes)
    parts = []
    for j0 in range(0, mats.shape[0], step):
        mapped = torch.einsum("etr,frc->etfc", rows, mats[j0:j0 + step])
        parts.append(torch.einsum("etfc,etc->etf", mapped, cols))
    return torch.cat(parts, dim=2)


def _dense_factor(f: Tensor, width: int) -> Tensor:
    if not is_index(f):
        return f.to(torch.float32)
    hot = torch.nn.functional.one_hot(f.clamp(min=0), width).to(torch.float32)
    return hot * (f >= 0).unsqueeze(-1).to(torch.float32)


def token_inner(a: GradientBatch, b: GradientBatch, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """Per-token decomposition of ``inner(a, b)``: ``[E1, T, E2]`` whose sum over ``T`` is the
    ``[E1, E2]`` inner product exactly. ``T`` is ``a.num_tokens`` (the token positions of ``a``'s
    examples); a layer used ``m`` times per forward contributes each use at its token position."""
    check_compatible(a, b, "per-token inner product")
    length = a.num_tokens
    if length is None:
        raise ValueError("these gradients have no common token axis (non-sequence inputs)")
    out = torch.zeros(len(a), length, len(b), dtype=torch.float32)
    for name, pa in a.params.items():
        pb = b.params[name]
        for ta in pa.terms:
            part = _token_part(ta, pb, max_bytes)
            tokens = part.shape[1]
            if tokens % length != 0 and tokens != length:
                raise ValueError(f"{name}: {tokens} token positions do not fold onto {length} tokens per example")
            if tokens != length:
                part = part.view(part.shape[0], tokens // length, length, part.shape[2]).sum(1)
            out = out.to(part.device) + part
    return out


def concat(batches: Sequence[GradientBatch]) -> GradientBatch:
    """Concatenate batches along the example axis (same parameters, projection, shapes, dtypes)."""
    if not batches:
        raise ValueError("concat() needs at least one batch")
    first = batches[0]
    for other in batches[1:]:
        check_compatible(first, other, "concat")
    params = {}
    for name, pg in first.params.items():
        groups = [b.params[name].terms for b in batches]
        if len({len(g) for g in groups}) != 1:
            raise IncompatibleGradients(f"concat: {name} has a different number of terms across batches")
        terms = [cat_terms([g[k] for g in groups], dim=0) for k in range(len(groups[0]))]
        params[name] = dataclasses.replace(pg, terms=terms)

    def cat_opt(values):
        return None if any(v is None for v in values) else torch.cat(list(values))

    meta = {}
    for key, value in first.meta.items():
        if isinstance(value, list) and all(isinstance(b.meta.get(key), list) for b in batches):
            meta[key] = [x for b in batches for x in b.meta[key]]
    lengths = [b.num_tokens for b in batches]
    # the convention, step and projection are the first batch's (check_compatible made them agree)
    return dataclasses.replace(first, ids=[i for b in batches for i in b.ids], params=params,
                               scale=torch.cat([b.scale for b in batches]),
                               nonfinite=cat_opt([b.nonfinite for b in batches]),
                               num_targets=cat_opt([b.num_targets for b in batches]),
                               meta=meta, num_tokens=None if None in lengths else max(lengths))


def to(
    batch: GradientBatch, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GradientBatch:
    """Move a batch (float factors cast to ``dtype`` if given; ids/index factors only moved)."""

    def move(x: Tensor) -> Tensor:
        if dtype is not None and x.is_floating_point():
            return x.to(device=device, dtype=dtype)
        return x.to(device=device) if device is not None else x

    out = batch._with_params({n: pg.map_examples(move) for n, pg in batch.params.items()})
    if device is not None:
        out.scale = batch.scale.to(device)
    return out


def weighted_sum(pg: ParamGradient, weights: Tensor) -> Tensor:
    """``sum_e weights[e] * G_e`` of one parameter (shape ``pg.shape``), without forming per-example gradients:
    one matrix product (or scatter) per term. Examples with weight zero cost nothing."""
    weights = weights.to(torch.float32)
    nonzero = weights.nonzero().flatten()
    if len(nonzero) == 0:
        return torch.zeros(pg.shape, dtype=torch.float32, device=_term_device(pg.terms[0]) if pg.terms else None)
    if len(nonzero) < len(weights):  # e.g. only the dropped examples of a selection step
        pg = pg.map_examples(lambda t: t.index_select(0, nonzero.to(t.device)))
        weights = weights[nonzero]
    total = None
    for term in pg.terms:
        w = weights.to(_term_device(term))
        if isinstance(term, OuterTerm):
            part = _weighted_outer(term, w)
        elif isinstance(term, VectorTerm):
            part = (term.values.to(torch.float32) * w[:, None, None]).sum((0, 1))
        else:
            part = (term.values.to(torch.float32).reshape(term.num_examples, -1) * w[:, None]).sum(0)
        part = part.reshape(pg.shape)
        total = part if total is None else total + part
    return total


def _term_device(term: Term) -> torch.device:
    return (term.rows if isinstance(term, OuterTerm) else term.values).device


def _weighted_outer(term: OuterTerm, w: Tensor) -> Tensor:
    if is_index(term.rows):
        cols = (term.cols.to(torch.float32) * w[:, None, None]).reshape(-1, term.n_cols)
        ids = term.rows.reshape(-1)
        out = torch.zeros(term.n_rows, term.n_cols, device=cols.device)
        keep = ids >= 0
        return out.index_add_(0, ids[keep], cols[keep])
    rows = (term.rows.to(torch.float32) * w[:, None, None]).reshape(-1, term.n_rows)
    if is_index(term.cols):
        ids = term.cols.reshape(-1)
        out = torch.zeros(term.n_cols, term.n_rows, device=rows.device)
        keep = ids >= 0
        return out.index_add_(0, ids[keep], rows[keep]).t()
    return rows.t() @ term.cols.to(torch.float32).reshape(-1, term.n_cols)


def dense_inner(batch: GradientBatch, vectors: dict[str, Tensor]) -> Tensor:
    """``[E]``: ``sum_p <G_e,p, V_p>`` of every example's gradient with one dense gradient ``V`` (``{name: tensor
    of the parameter's (projected) shape}``), e.g. a target direction. Factorized terms are contracted token by
    token (``r_t^T V c_t``), never materialized per example."""
    missing = [n for n in batch.params if n not in vectors]
    if missing:
        raise IncompatibleGradients(f"the dense gradient lacks parameters {missing[:3]}")
    out = torch.zeros(len(batch), dtype=torch.float32)
    for name, pg in batch.params.items():
        target = vectors[name].to(torch.float32)
        for term in pg.terms:
            v = target.to(_term_device(term))
            if isinstance(term, OuterTerm):
                part = _outer_dense_inner(term, v.reshape(term.n_rows, term.n_cols))
            elif isinstance(term, VectorTerm):
                part = (term.values.to(torch.float32) @ v.reshape(-1)).sum(1)
            else:
                part = term.values.to(torch.float32).reshape(term.num_examples, -1) @ v.reshape(-1)
            out = out.to(part.device) + part
    return out


def _outer_dense_inner(term: OuterTerm, matrix: Tensor) -> Tensor:
    """``[E]``: ``sum_t r_t^T M c_t`` for one outer term."""
    if is_index(term.rows):
        picked = matrix.index_select(0, term.rows.clamp(min=0).reshape(-1)).reshape(*term.rows.shape, -1)
        picked = picked * (term.rows >= 0).unsqueeze(-1)
        return (picked * term.cols.to(torch.float32)).sum((1, 2))
    if is_index(term.cols):
        picked = matrix.t().index_select(0, term.cols.clamp(min=0).reshape(-1)).reshape(*term.cols.shape, -1)
        picked = picked * (term.cols >= 0).unsqueeze(-1)
        return (picked * term.rows.to(torch.float32)).sum((1, 2))
    return ((term.rows.to(torch.float32) @ matrix) * term.cols.to(torch.float32)).sum((1, 2))
