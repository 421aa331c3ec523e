"""Assemble the per-site results of one backward pass into a :class:`GradientBatch`.

Each use of a captured module in a forward call (a *site*) yields per-row terms ``[B, T, ...]``.
Here they are mapped to examples (packed rows split into documents), joined per parameter --
sites of one forward call along the token axis (a module called twice, tied weights of the same
kind), forward calls along the example axis -- and checked for NaN/inf per example.

Positions that belong to no example (padding) never make an example non-finite: a padding position holding a
NaN/inf is replaced by 0 (:func:`zero_outside`), which is what a finite padded position contributes anyway (no loss
reaches it). Positions inside examples are never changed.

:func:`build_batch` then reduces the joined terms over tokens under LoGra (unless tokens are kept) and gives the
examples their ids, loss scales and target counts; examples with NaN/inf gradients are flagged (or raise),
examples without a target token are warned about.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..grad.batch import GradientBatch, ParamGradient
from ..grad.terms import OuterTerm, Term, VectorTerm, cat_terms, fill_value, is_index, map_tensors, term_tensors
from ..loss.functions import LossConvention
from .context import ForwardContext
from .example_ids import ExampleIds

if TYPE_CHECKING:
    from .collector import Capture

__all__ = ["LaterTerm", "SiteResult", "build_batch", "join_terms", "nonfinite_examples", "outside_examples",
           "zero_outside"]


class LaterTerm:
    """A layer's term that a hook further down the same backward pass delivers (the fused experts' up-projection,
    from the gradient autograd computes at its hidden values); resolved when the batch is built."""

    __slots__ = ("term", "what")

    def __init__(self, what: str) -> None:
        self.what, self.term = what, None

    def deliver(self, term: Term) -> None:
        self.term = term

    def resolve(self) -> Term:
        if self.term is None:
            raise RuntimeError(f"gradtrace: the gradient term of {self.what} was not delivered in its backward pass")
        return self.term


@dataclass
class SiteResult:
    """Terms produced by one module call: ``{parameter name: per-row term}``."""

    context: ForwardContext
    order: int
    terms: dict[str, Term]


def _signature(term: Term) -> tuple:
    if isinstance(term, OuterTerm):
        return ("outer", is_index(term.rows), is_index(term.cols), term.n_rows, term.n_cols,
                term.rows.dtype, term.cols.dtype)
    if isinstance(term, VectorTerm):
        return ("vector", term.values.shape[-1], term.values.dtype)
    raise TypeError(f"cannot join terms of type {type(term).__name__}")


def _empty_like(term: Term, num_examples: int) -> Term:
    return map_tensors(term, lambda x: x.new_full((num_examples, 1, *x.shape[2:]), fill_value(x)))


def outside_examples(context: ForwardContext) -> Tensor | None:
    """``[B, T]`` bool: the positions of a forward call's rows that belong to no example (padding, gaps
    between packed documents); None when there are none or the call has no token layout."""
    if context.seq_len is None:
        return None
    if context.packed:
        outside = context.example_of_token < 0
    elif context.valid is not None:
        outside = ~context.valid
    else:
        return None
    return outside if bool(outside.any()) else None


CPU_FAST_PATH = True
"""Let :func:`zero_outside` skip its copy on the CPU after one host read (free there); the host-read test turns it
off to run the device path on the CPU."""


def zero_outside(x: Tensor, outside: Tensor | None, dim: int = 1) -> Tensor:
    """``x`` (``[B, T, ...]``) with every ``outside`` position (``[B, T]``) that holds a NaN/inf set to 0 (the
    whole position: a position's values summed, a non-finite sum marks it). ``dim``: the dim of ``x`` holding the
    positions when it is not 1 (attention weights ``[B, heads, T, keys]``: 2).

    Positions inside examples are never changed, nor are finite padding positions (an overflowing sum of finite
    values aside); tensors of another layout (integer ids, other position counts) are returned unchanged.

    On a device there is no host read (which would stop the CPU until the device catches up, once per layer per
    hook): a per-position sum, a ``[B, T]`` mask and one ``masked_fill`` (whose backward keeps only that mask, not
    one of ``x``'s size), at the cost of one copy of ``x``. On the CPU, where reading a value waits for nothing,
    the common case -- nothing non-finite -- costs one sum and returns ``x`` itself (:data:`CPU_FAST_PATH`; the
    device path measured 1.14x the CPU time of a padded LoGra ``collect``); the results are the same.
    """
    if dim != 1 and outside is not None and x.dim() > dim:
        moved = x.movedim(dim, 1)
        cleaned = zero_outside(moved, outside)
        return x if cleaned is moved else cleaned.movedim(1, dim)
    if outside is None or not x.is_floating_point() or x.dim() < 2 or tuple(x.shape[:2]) != tuple(outside.shape):
        return x
    if CPU_FAST_PATH and x.device.type == "cpu" and bool(torch.isfinite(x.sum())):
        return x
    per_position = x.flatten(2).sum(dim=-1) if x.dim() > 2 else x
    bad = outside.to(x.device) & ~torch.isfinite(per_position)
    return x.masked_fill(bad.view(*bad.shape, *(1,) * (x.dim() - 2)), 0)


def join_terms(entries: list[tuple[ForwardContext, int, Term]], contexts: list[ForwardContext],
               sum_contexts: bool, outside: dict[int, Tensor | None] | None = None) -> list[Term]:
    """Join one parameter's site terms into per-example terms (one per signature).

    entries: ``(context, call order, per-row term)`` for every site of the parameter, or ``(context, call order,
        per-row term, part)`` where a site's gradient is a sum of several terms (parts are joined apart, then summed).
    contexts: all forward calls of the step, in order (their examples are concatenated, unless
        ``sum_contexts``, in which case row ``i`` of every call is the same example).
    outside: ``{context index: [B, T] positions outside every example}`` (see :func:`outside_examples`);
        NaN/inf there do not reach the examples' terms.
    """
    outside = outside or {}
    groups: dict[tuple, dict[int, list[Term]]] = {}
    for context, _order, term, *part in sorted(entries, key=lambda e: (e[0].index, e[1])):
        mask = outside.get(context.index)
        if mask is not None:
            term = map_tensors(term, lambda x, mask=mask: zero_outside(x, mask))
        per_example = map_tensors(term, context.relayout)
        key = (_signature(per_example), *part)
        groups.setdefault(key, {}).setdefault(context.index, []).append(per_example)
    joined: list[Term] = []
    for by_context in groups.values():
        per_context = {i: cat_terms(terms, dim=1) for i, terms in by_context.items()}
        if sum_contexts:
            joined.append(cat_terms(list(per_context.values()), dim=1))
            continue
        template = next(iter(per_context.values()))
        parts = [per_context.get(c.index) or _empty_like(template, c.num_examples) for c in contexts]
        joined.append(cat_terms(parts, dim=0))
    return joined


def nonfinite_examples(terms: list[Term], num_examples: int, device: torch.device) -> Tensor:
    """``[E]`` bool: examples with a NaN or inf in any float factor.

    One reduction pass per factor: a NaN or inf entry makes the example's sum non-finite (as does a sum
    overflowing float32, whose gradient would be unusable anyway).
    """
    bad = torch.zeros(num_examples, dtype=torch.bool, device=device)
    for term in terms:
        for x in term_tensors(term).values():
            if x.is_floating_point():
                sums = x.reshape(x.shape[0], -1).sum(1, dtype=torch.float32)
                bad |= ~torch.isfinite(sums).to(device)
    return bad


def build_batch(capture: Capture, results: list[SiteResult], step: int, convention: LossConvention,
                ids: ExampleIds) -> GradientBatch:
    """The :class:`GradientBatch` of backward pass ``step`` from its layer ``results`` (``capture``'s layers,
    projection and settings; ``convention``: the loss convention in force, a side pass's own one included)."""
    results = [SiteResult(r.context, r.order, {n: t.resolve() if isinstance(t, LaterTerm) else t
                                               for n, t in r.terms.items()}) for r in results]
    contexts = sorted({id(r.context): r.context for r in results}.values(), key=lambda c: c.index)
    sum_contexts = capture.multi_forward == "sum" and len(contexts) > 1
    if sum_contexts and len({c.num_examples for c in contexts}) != 1:
        raise ValueError("gradtrace: multi_forward='sum' needs the same number of examples in every forward "
                         f"call, got {[c.num_examples for c in contexts]}")
    params = _param_gradients(capture, results, contexts, sum_contexts)
    used = contexts[:1] if sum_contexts else contexts
    resolved = [ids.resolve(c) for c in used]
    names = [i for call_ids, _ in resolved for i in call_ids]
    digests = None if any(d is None for _, d in resolved) else [x for _, d in resolved for x in d]
    first = next(iter(params.values())).terms[0]
    device = next(iter(term_tensors(first).values())).device
    scale = torch.cat([c.example_scale.to(device) for c in used])
    num_targets = None
    if all(c.num_targets is not None for c in used):
        num_targets = torch.cat([c.num_targets.to(device) for c in used])
    bad = nonfinite_examples([t for pg in params.values() for t in pg.terms], len(names), device)
    projection = capture.projection
    batch = GradientBatch(ids=names, params=params, scale=scale, convention=convention, step=step,
                          nonfinite=bad, num_targets=num_targets,
                          projection=projection.to_dict() if projection is not None else None,
                          meta={"forward_call": [c.index for c in used for _ in range(c.num_examples)],
                                **({"digest": digests} if digests is not None else {})},
                          num_tokens=_token_axis(contexts))
    if bool(bad.any()):
        flagged = [names[i] for i in bad.nonzero().flatten().tolist()]
        message = (f"gradtrace: {len(flagged)} example(s) have NaN/inf gradients in backward pass {step}: "
                   f"{', '.join(flagged[:5])}{' ...' if len(flagged) > 5 else ''} (flagged in batch.nonfinite)")
        if capture.nonfinite == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, stacklevel=3)
    if num_targets is not None:
        _warn_no_targets(names, num_targets, step)
    return batch


def _param_gradients(capture: Capture, results: list[SiteResult], contexts: list[ForwardContext],
                     sum_contexts: bool) -> dict[str, ParamGradient]:
    """Each captured parameter's per-example gradient, in the capture's parameter order."""
    by_param: dict[str, list] = {}
    for r in results:
        for name, term in r.terms.items():
            if isinstance(term, list):  # a sum of parts (an experts layer's routing slots)
                by_param.setdefault(name, []).extend((r.context, r.order, t, part) for part, t in enumerate(term))
            else:
                by_param.setdefault(name, []).append((r.context, r.order, term))
    shapes = {h.params[role]: h.shapes[role] for h in capture.handlers for role in h.params}
    # padded positions are no example's: their NaN/inf must not make an example non-finite (packed rows
    # are split into documents by relayout, which drops them already)
    outside = {c.index: outside_examples(c) for c in contexts if not c.packed}
    projector = capture.projector
    params: dict[str, ParamGradient] = {}
    for name in capture.selection.param_order:
        if name not in by_param:
            continue
        terms = join_terms(by_param[name], contexts, sum_contexts, outside)
        shape = tuple(terms[0].shape) if projector is not None else shapes[name]
        grad = ParamGradient(name, shape, terms, projected=projector is not None)
        if projector is not None and not capture.projection.keep_tokens:
            grad = grad.reduced()
        params[name] = grad
    return params


def _warn_no_targets(ids: list[str], num_targets: Tensor, step: int) -> None:
    """Warn about examples without a target token: their loss, hence their gradient, is zero."""
    empty = (num_targets == 0).nonzero().flatten().tolist()
    if empty:
        names = [ids[i] for i in empty]
        warnings.warn(f"gradtrace: {len(names)} example(s) have no target token in backward pass {step} (a single "
                      f"token, or every label ignored), so their gradients are zero: {', '.join(names[:5])}"
                      f"{' ...' if len(names) > 5 else ''}", stacklevel=4)


def _token_axis(contexts: list[ForwardContext]) -> int | None:
    """Token positions per example when every forward call had sequence inputs."""
    if any(c.seq_len is None for c in contexts):
        return None
    return max(c.example_len if c.packed else c.seq_len for c in contexts)
