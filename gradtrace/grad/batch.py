"""``GradientBatch``: the per-example gradients of one backward pass, keyed by parameter name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..loss.functions import LossConvention
from .terms import DenseTerm, OuterTerm, Term, VectorTerm

__all__ = ["GradientBatch", "ParamGradient", "vectors_to_batch"]


@dataclass
class ParamGradient:
    """The per-example gradient of one parameter, kept as a sum of terms.

    name: parameter name as in ``model.named_parameters()``.
    shape: shape of one example's gradient: the parameter's shape, or the projected shape.
    terms: the pieces (one per kind of use site), all with the same example axis.
    projected: whether the terms live in a projected space.
    """

    name: str
    shape: tuple[int, ...]
    terms: list[Term]
    projected: bool = False

    @property
    def num_examples(self) -> int:
        return self.terms[0].num_examples

    @property
    def numel(self) -> int:
        """Dimension of one example's (flattened) gradient."""
        return math.prod(self.shape)

    def materialize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Per-example gradients ``[E, *shape]``, summed over terms and tokens in ``dtype``."""
        total = None
        for term in self.terms:
            part = term.materialize(dtype).reshape(term.num_examples, *self.shape)
            total = part if total is None else total + part
        return total

    def flat(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Per-example gradients flattened to ``[E, numel]``."""
        return self.materialize(dtype).reshape(self.num_examples, -1)

    @property
    def num_rows(self) -> int:
        """Rows of the gradient viewed as a matrix ``[shape[0], numel / shape[0]]``."""
        return self.shape[0]

    def flat_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows ``start:stop`` of each example's gradient matrix, flattened: ``[E, (stop-start) * cols]``.

        Computed from the terms directly, so a weight-sized gradient is never formed whole.
        """
        total = None
        for term in self.terms:
            if isinstance(term, DenseTerm):
                part = term.values.reshape(term.num_examples, self.num_rows, -1)[:, start:stop].to(dtype)
            else:
                part = term.materialize_rows(start, stop, dtype)
            part = part.reshape(term.num_examples, -1)
            total = part if total is None else total + part
        return total

    def reduced(self) -> ParamGradient:
        """The same gradient with its token axis summed away (one dense term)."""
        if len(self.terms) == 1 and isinstance(self.terms[0], DenseTerm):
            return self
        return ParamGradient(self.name, self.shape, [DenseTerm(self.flat())], self.projected)

    def map_examples(self, fn) -> ParamGradient:
        return ParamGradient(self.name, self.shape, [t.map_examples(fn) for t in self.terms], self.projected)


@dataclass
class GradientBatch:
    """Per-example gradients of one backward pass.

    ids: one id per example (example axis order).
    params: parameter name -> :class:`ParamGradient`, in ``model.named_parameters()`` order.
    scale: ``[E]`` factor the capture multiplied hook gradients by to obtain each example's own
        loss gradient (the loop's reduction removed; e.g. the batch size for a mean loss).
    convention: the :class:`LossConvention` in force.
    step: index of the backward pass within the capture session (0-based).
    nonfinite: ``[E]`` bool, True for examples with a NaN or inf anywhere in their gradient.
    num_targets: ``[E]`` number of target tokens (loss terms) of each example, when known.
    projection: the projection spec (a dict), or None for exact gradients.
    meta: free-form extras (e.g. ``forward_call`` of each example).
    num_tokens: token positions per example of sequence inputs (the token axis of per-token results),
        None for non-sequence inputs.
    """

    ids: list[str]
    params: dict[str, ParamGradient]
    scale: Tensor
    convention: LossConvention = field(default_factory=LossConvention)
    step: int = 0
    nonfinite: Tensor | None = None
    num_targets: Tensor | None = None
    projection: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    num_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def param_names(self) -> list[str]:
        return list(self.params)

    @property
    def dims(self) -> dict[str, int]:
        """Flattened gradient dimension of each parameter."""
        return {name: pg.numel for name, pg in self.params.items()}

    def per_example_grads(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """``{parameter name: [E, *param.shape]}``, summed over tokens and use sites.

        Raises for projected batches, whose gradients no longer have the parameter's shape
        (use :meth:`flat` for the projected vectors).
        """
        if self.projection is not None:
            raise ValueError(
                "this batch holds projected gradients; per_example_grads() needs an exact capture "
                "(projection=None). Use GradientBatch.flat() for the projected vectors."
            )
        return {name: pg.materialize(dtype) for name, pg in self.params.items()}

    def flat(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """All parameters' per-example gradients concatenated: ``[E, sum(dims)]``."""
        return torch.cat([pg.flat(dtype) for pg in self.params.values()], dim=1)

    def reduced(self) -> GradientBatch:
        """A copy whose gradients are summed over tokens (dense ``[E, dim]`` per parameter)."""
        return self._with_params({n: pg.reduced() for n, pg in self.params.items()})

    def select(self, index: Tensor | list[int] | slice) -> GradientBatch:
        """The examples at ``index`` (along the example axis)."""
        if isinstance(index, slice):
            positions = list(range(len(self.ids)))[index]
        else:
            positions = [int(i) for i in (index.tolist() if isinstance(index, Tensor) else index)]
        pos = torch.tensor(positions, dtype=torch.long)

        def take(tensor: Tensor) -> Tensor:
            return tensor.index_select(0, pos.to(tensor.device))

        out = self._with_params({n: pg.map_examples(take) for n, pg in self.params.items()})
        out.ids = [self.ids[i] for i in positions]
        out.scale = take(self.scale)
        out.nonfinite = None if self.nonfinite is None else take(self.nonfinite)
        out.num_targets = None if self.num_targets is None else take(self.num_targets)
        out.meta = {k: ([v[i] for i in positions] if isinstance(v, list) and len(v) == len(self.ids) else v)
                    for k, v in self.meta.items()}
        return out

    def _with_params(self, params: dict[str, ParamGradient]) -> GradientBatch:
        return GradientBatch(
            ids=list(self.ids), params=params, scale=self.scale, convention=self.convention,
            step=self.step, nonfinite=self.nonfinite, num_targets=self.num_targets,
            projection=self.projection, meta=dict(self.meta), num_tokens=self.num_tokens,
        )

    # -- operations (see gradtrace.grad.ops) ----------------------------------------------------
    def inner(self, other: GradientBatch, **kwargs: Any) -> Any:
        """``[E, E_other]`` inner products with ``other`` (see :func:`gradtrace.grad.ops.inner`)."""
        from .ops import inner

        return inner(self, other, **kwargs)

    def sq_norms(self, **kwargs: Any) -> Any:
        """``[E]`` squared gradient norms (see :func:`gradtrace.grad.ops.sq_norms`)."""
        from .ops import sq_norms

        return sq_norms(self, **kwargs)

    def token_inner(self, other: GradientBatch, **kwargs: Any) -> Tensor:
        """``[E, T, E_other]`` per-token decomposition of :meth:`inner`."""
        from .ops import token_inner

        return token_inner(self, other, **kwargs)

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> GradientBatch:
        """A copy moved to ``device`` and/or with float factors cast to ``dtype``."""
        from .ops import to

        return to(self, device=device, dtype=dtype)

    def __repr__(self) -> str:
        kinds = {type(t).__name__ for pg in self.params.values() for t in pg.terms}
        proj = "exact" if self.projection is None else f"projected {self.projection.get('kind')}"
        return (f"GradientBatch(examples={len(self)}, params={len(self.params)}, dim={sum(self.dims.values())}, "
                f"{proj}, terms={sorted(kinds)}, step={self.step})")


def term_kind(term: Term) -> str:
    """A short name of a term's kind, used in reports and manifests."""
    if isinstance(term, OuterTerm):
        return "outer"
    if isinstance(term, VectorTerm):
        return "vector"
    return "dense"


def vectors_to_batch(vectors: Tensor, like: GradientBatch) -> GradientBatch:
    """Dense ``[Q, D]`` vectors as a :class:`GradientBatch` with the parameter layout of batch ``like``."""
    params, start = {}, 0
    for name, pg in like.params.items():
        stop = start + pg.numel
        params[name] = ParamGradient(name, pg.shape, [DenseTerm(vectors[:, start:stop].reshape(-1, *pg.shape))],
                                     pg.projected)
        start = stop
    return GradientBatch(ids=[str(i) for i in range(vectors.shape[0])], params=params,
                         scale=torch.ones(vectors.shape[0]), convention=like.convention, projection=like.projection)
