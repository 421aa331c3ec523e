"""Assemble the per-site results of one backward pass into a :class:`GradientBatch`.

Each use of a captured module in a forward call (a *site*) yields per-row terms ``[B, T, ...]``.
Here they are mapped to examples (packed rows split into documents), joined per parameter --
sites of one forward call along the token axis (a module called twice, tied weights of the same
kind), forward calls along the example axis -- and checked for NaN/inf per example.

Positions that belong to no example (padding) never make an example non-finite: their NaN/inf are
replaced by 0 (:func:`zero_outside`), which is what a finite padded position contributes anyway (no loss
reaches it). Finite values are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..grad.terms import OuterTerm, Term, VectorTerm, cat_terms, fill_value, is_index, map_tensors, term_tensors
from .context import ForwardContext

__all__ = ["SiteResult", "join_terms", "nonfinite_examples", "outside_examples", "zero_outside"]


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


def zero_outside(x: Tensor, outside: Tensor | None) -> Tensor:
    """``x`` (``[B, T, ...]``) with its NaN/inf at the ``outside`` positions (``[B, T]``) replaced by 0.

    Finite values are left as they are; tensors of another layout (integer ids, other position counts) are
    returned unchanged. The common case -- nothing non-finite -- costs one sum over ``x`` (a reduction, no
    copy: a NaN/inf anywhere makes it non-finite) and returns ``x`` itself; only then are the outside
    positions read.
    """
    if outside is None or not x.is_floating_point() or x.dim() < 2 or tuple(x.shape[:2]) != tuple(outside.shape):
        return x
    if bool(torch.isfinite(x.sum())):  # an overflowing sum of finite values falls through to the exact check
        return x
    outside = outside.to(x.device)
    if bool(torch.isfinite(x[outside]).all()):
        return x
    where = outside.view(*outside.shape, *(1,) * (x.dim() - 2))
    return x.masked_fill(where & ~torch.isfinite(x), 0)


def join_terms(entries: list[tuple[ForwardContext, int, Term]], contexts: list[ForwardContext],
               sum_contexts: bool, outside: dict[int, Tensor | None] | None = None) -> list[Term]:
    """Join one parameter's site terms into per-example terms (one per signature).

    entries: ``(context, call order, per-row term)`` for every site of the parameter.
    contexts: all forward calls of the step, in order (their examples are concatenated, unless
        ``sum_contexts``, in which case row ``i`` of every call is the same example).
    outside: ``{context index: [B, T] positions outside every example}`` (see :func:`outside_examples`);
        NaN/inf there do not reach the examples' terms.
    """
    outside = outside or {}
    groups: dict[tuple, dict[int, list[Term]]] = {}
    for context, _order, term in sorted(entries, key=lambda e: (e[0].index, e[1])):
        mask = outside.get(context.index)
        if mask is not None:
            term = map_tensors(term, lambda x, mask=mask: zero_outside(x, mask))
        per_example = map_tensors(term, context.relayout)
        groups.setdefault(_signature(per_example), {}).setdefault(context.index, []).append(per_example)
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
