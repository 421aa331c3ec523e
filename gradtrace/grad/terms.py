"""Per-example gradient *terms*: the pieces a parameter's per-example gradient is made of.

A captured parameter gradient is a sum of terms, one kind per way a layer produces it:

* :class:`OuterTerm` -- matrix parameters (Linear, Conv1D, Embedding, Conv): the per-example
  gradient is ``sum_t rows_t (x) cols_t`` over the example's tokens. A factor is either dense
  ``[E, T, n]`` or an index factor ``[E, T]`` (integer ids of a one-hot vector of width ``n``,
  ``-1`` meaning "no row"), which is how embeddings are kept.
* :class:`VectorTerm` -- vector parameters (biases, norm weights): ``sum_t values_t``.
* :class:`DenseTerm` -- an already summed ``[E, n]`` gradient (materialized or projected).

Every term keeps the example axis first, so slicing, moving and concatenating examples is uniform.
Terms never hold a loss scale: they are already in the per-example loss convention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

__all__ = ["DenseTerm", "OuterTerm", "Term", "VectorTerm", "cat_terms", "fill_value", "is_index", "map_tensors",
           "term_tensors"]


def is_index(factor: Tensor) -> bool:
    """Whether a factor holds one-hot indices (``[E, T]`` integers) rather than dense vectors."""
    return not factor.is_floating_point()


def _dense(factor: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """Turn an index factor ``[E, T]`` into its dense one-hot form ``[E, T, width]``."""
    if not is_index(factor):
        return factor.to(dtype)
    hot = torch.nn.functional.one_hot(factor.clamp(min=0), width).to(dtype)
    return hot * (factor >= 0).unsqueeze(-1).to(dtype)


class _PerExample:
    """What every term shares: each tensor field has the example axis first."""

    def map_examples(self, fn: Callable[[Tensor], Tensor]) -> Term:
        """The term with ``fn`` applied to each of its tensor fields (an index, a slice, a move of examples)."""
        return map_tensors(self, fn)


@dataclass
class OuterTerm(_PerExample):
    """Per-example gradient ``G_e = sum_t rows[e, t] (x) cols[e, t]`` of a matrix parameter.

    rows: ``[E, T, n_rows]`` float, or ``[E, T]`` integer ids of one-hot rows (``-1`` = none).
    cols: ``[E, T, n_cols]`` float, or ``[E, T]`` integer ids.
    n_rows, n_cols: widths of the two factors (needed for index factors).
    """

    rows: Tensor
    cols: Tensor
    n_rows: int
    n_cols: int

    @property
    def num_examples(self) -> int:
        return self.rows.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """The (rows, cols) shape of one example's gradient matrix."""
        return (self.n_rows, self.n_cols)

    def materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The summed per-example gradients ``[E, n_rows, n_cols]``, accumulated in ``dtype``."""
        if is_index(self.rows) and is_index(self.cols):
            raise ValueError("an outer term needs at least one dense factor")
        if is_index(self.rows):
            return _scatter_rows(self.rows, self.cols.to(dtype), self.n_rows)
        if is_index(self.cols):
            return _scatter_rows(self.cols, self.rows.to(dtype), self.n_cols).transpose(1, 2)
        return torch.einsum("etr,etc->erc", self.rows.to(dtype), self.cols.to(dtype))

    def materialize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows ``start:stop`` of the summed per-example gradients: ``[E, stop - start, n_cols]``."""
        if is_index(self.rows):
            ids = self.rows - start
            ids = torch.where((ids >= 0) & (ids < stop - start), ids, torch.full_like(ids, -1))
            return _scatter_rows(ids, self.cols.to(dtype), stop - start)
        rows = self.rows[:, :, start:stop].to(dtype)
        if is_index(self.cols):
            return _scatter_rows(self.cols, rows, self.n_cols).transpose(1, 2)
        return torch.einsum("etr,etc->erc", rows, self.cols.to(dtype))

    def token_materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Per-token gradients ``[E, T, n_rows, n_cols]`` (small shapes only: token attribution)."""
        rows = _dense(self.rows, self.n_rows, dtype)
        cols = _dense(self.cols, self.n_cols, dtype)
        return rows.unsqueeze(-1) * cols.unsqueeze(-2)



@dataclass
class _SummedValues(_PerExample):
    """A term held as one tensor ``values`` with the example axis first."""

    values: Tensor

    @property
    def num_examples(self) -> int:
        return self.values.shape[0]


@dataclass
class VectorTerm(_SummedValues):
    """Per-example gradient ``g_e = sum_t values[e, t]`` of a vector parameter. values: ``[E, T, n]``."""

    @property
    def num_tokens(self) -> int:
        return self.values.shape[1]

    @property
    def shape(self) -> tuple[int]:
        return (self.values.shape[-1],)

    def materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Summed per-example gradients ``[E, n]``."""
        return self.values.to(dtype).sum(1)

    def materialize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Entries ``start:stop``: ``[E, stop - start, 1]``."""
        return self.values[:, :, start:stop].to(dtype).sum(1).unsqueeze(-1)

    def token_materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.values.to(dtype)


@dataclass
class DenseTerm(_SummedValues):
    """An already summed per-example gradient. values: ``[E, *shape]``."""

    @property
    def num_tokens(self) -> int:
        return 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    def materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.values.to(dtype)

    def token_materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.values.to(dtype).unsqueeze(1)

Term = OuterTerm | VectorTerm | DenseTerm


def _scatter_rows(index: Tensor, values: Tensor, width: int) -> Tensor:
    """``out[e, index[e, t], :] += values[e, t, :]`` for all tokens; ids ``< 0`` are skipped.

    index: ``[E, T]`` integers; values: ``[E, T, n]``; returns ``[E, width, n]``.
    """
    num_examples, _, n = values.shape
    keep = index >= 0
    flat = (torch.arange(num_examples, device=index.device).unsqueeze(1) * width + index.clamp(min=0))
    out = values.new_zeros(num_examples * width, n)
    out.index_add_(0, flat[keep], values[keep])
    return out.view(num_examples, width, n)


# -- joining terms: one rule for capture (sites -> examples) and for concat() (batches -> one batch) ----------------
def term_tensors(term: Term) -> dict[str, Tensor]:
    """The tensor fields of a term (all with the example axis first)."""
    return {f.name: getattr(term, f.name) for f in fields(term) if isinstance(getattr(term, f.name), Tensor)}


def map_tensors(term: Term, fn: Callable[[Tensor], Tensor]) -> Term:
    """``term`` with ``fn`` applied to each of its tensor fields."""
    return replace(term, **{k: fn(v) for k, v in term_tensors(term).items()})


def fill_value(x: Tensor) -> int:
    """What a position holding nothing contains: 0 in a dense factor, -1 (no row) in an index factor."""
    return 0 if x.is_floating_point() else -1


def _pad_tokens(x: Tensor, length: int) -> Tensor:
    """``x`` (``[E, T, ...]``) padded with :func:`fill_value` to ``length`` tokens."""
    if x.shape[1] == length:
        return x
    pad = x.new_full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill_value(x))
    return torch.cat([x, pad], dim=1)


def cat_terms(terms: list[Term], dim: int) -> Term:
    """Concatenate same-kind terms along the example (0) or token (1) axis; along examples, shorter token axes
    are padded with positions that hold nothing."""
    if len(terms) == 1:
        return terms[0]
    length = max(t.num_tokens for t in terms)
    joined = {}
    for key in term_tensors(terms[0]):
        parts = [getattr(t, key) for t in terms]
        if dim == 0:
            parts = [_pad_tokens(p, length) for p in parts]
        joined[key] = torch.cat(parts, dim=dim)
    return replace(terms[0], **joined)
