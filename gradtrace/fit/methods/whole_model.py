"""Whole-model influence: ``tau(q, i) = g_q^T (G + lambda I)^-1 g_i`` with ``G`` the Gauss-Newton / Fisher matrix of
*all* captured parameters together (cross-layer terms included), from matrix-vector products with the model.

* ``arnoldi`` -- Schioppa et al. 2022: the top-``rank`` eigenpairs ``(e_k, u_k)`` of ``G`` from Arnoldi iterations,
  then ``sum_k u_k u_k^T q / (e_k + lambda)`` on that eigenspace plus its complement scaled by ``1 / (lambda + m)``,
  ``m`` the complement's mean eigenvalue (``complement="mean"``, default); ``"damping"`` scales it by ``1 / lambda``,
  the exact inverse of ``G_r + lambda I`` (``G_r`` the rank-``r`` truncation); ``"zero"`` drops it (the projection
  onto the top eigenspace, as Schioppa et al. do). All three tend to the exact influence as ``rank`` grows to ``P``.
* ``cg`` -- conjugate gradient on ``(G + lambda I) x = g_q`` for every query at once (one batched product per
  iteration), Jacobi-preconditioned.
* ``ggn_full`` -- the dense ``P x P`` matrix (``P`` products) and its eigendecomposition: the exact reference, for
  small models.

``fisher``: ``"exact"`` -- the Gauss-Newton matrix of gradtrace's classification / regression / causal-LM losses
(equal to the Fisher with the exact expectation over labels; for an LM over every token's label), from
``attr.fit(model, train_data, loss_fn)``; ``"empirical"`` -- ``(1/N) sum_i g_i g_i^T`` of the stored training
gradients (``attr.fit()``, no model pass); ``"auto"`` (default): exact for those losses, empirical for a custom
one. Damping: ``damping * mean eigenvalue`` (``trace(G) / P``; ``damping_mode="relative"``; default 0.1 for
``arnoldi``, :data:`WHOLE_MODEL_DAMPING` = 3.0 for ``cg`` and ``ggn_full``, chosen by
``bench/whole_model_damping.py``) or ``damping`` as is (``"absolute"``). The trace comes from ``diag(G)``: exact for the
empirical Fisher and for classifiers / regressors with at most 32 outputs (label enumeration), estimated with
``samples`` sampled labels per token for LMs (as ``kfac``'s ``fisher="true"``). Exact (unprojected) gradients
only. Positive = helpful.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...common.checks import at_least, count
from ...common.checks import seed as seed_of
from ...common.units import human_bytes
from ...options import FitOptions
from ...store.spec import GradientSpec, SpecMismatch, model_fingerprint
from ..curvature.curvature import CurvatureError
from ..curvature.hvp import (
    EmpiricalFisherOperator,
    GGNOperator,
    arnoldi,
    arnoldi_bytes,
    conjugate_gradient,
    dense_matrix,
    loss_kind,
)
from .base import Method, MissingStage, register_method

__all__ = ["WHOLE_MODEL_DAMPING", "Arnoldi", "ConjugateGradient", "DenseGGN"]


class _WholeModel(Method):
    needs = ("curvature",)
    uses_diagonal: ClassVar[bool] = True

    def __init__(self, damping: float = 0.1, damping_mode: str = "relative", fisher: str = "auto",
                 precision: str = "float32", chunk: int = 32, samples: int = 1, seed: int = 0) -> None:
        if damping_mode not in ("relative", "absolute"):
            raise ValueError(f"damping_mode must be 'relative' or 'absolute', got {damping_mode!r}")
        at_least(damping, "damping", 0)
        count(chunk, "chunk")
        count(samples, "samples")
        seed_of(seed)
        if fisher not in ("auto", "exact", "empirical"):
            raise ValueError(f"{self.name}: fisher must be 'auto', 'exact' (the Gauss-Newton matrix, computed exactly "
                             f"by products: no label sampling needed) or 'empirical', got {fisher!r}")
        if precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")
        self.damping, self.damping_mode, self.fisher = damping, damping_mode, fisher
        self.precision, self.chunk, self.samples, self.seed = precision, chunk, samples, seed
        self.operator: GGNOperator | EmpiricalFisherOperator | None = None
        self.spec: GradientSpec | None = None
        self.fisher_used: str | None = None
        self.trace_from: str | None = None
        self.mean_eigenvalue: float | None = None
        self.diagonal: Tensor | None = None
        self.fit_products = 0

    # -- fitting -----------------------------------------------------------------------------------
    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None) -> None:
        """Build the curvature operator for the training gradients' parameters (see the module docstring)."""
        spec = attributor.spec
        if spec.projection is not None:
            raise ValueError(f"{self.name} works on exact gradients over all captured parameters, these are "
                             f"projected ({spec.projection.get('kind', 'LoGra')}): collect the training and query "
                             "gradients without a projection (or use logra / trak for projected ones)")
        fisher = self.fisher
        if fisher != "empirical" and (model is None or data is None):
            raise MissingStage(f"{self.name}: the Gauss-Newton matrix needs attr.fit(model, train_data, loss_fn); "
                               "or pass fisher='empirical' to use the stored training gradients alone")
        if data is not None and iter(data) is data:
            data = list(data)
        if fisher == "auto":
            first = next(iter(data), None)
            if first is None:
                raise ValueError(f"{self.name}: the training data is empty")
            fisher = "empirical" if loss_kind(loss_fn, first) == "custom" else "exact"
        self._check_size(spec.dim)
        if model is not None:
            arch = model_fingerprint(model).get("arch")
            if spec.model.get("arch") and arch and spec.model["arch"] != arch:
                raise SpecMismatch(f"{self.name}: the training gradients come from another model "
                                   f"({spec.model.get('class')}); fit with the model they were collected from")
        if fisher == "empirical":
            self.operator = EmpiricalFisherOperator(attributor.train[0], block_rows=attributor.block_rows,
                                                    device=attributor.device, precision=self.precision)
        else:
            self.operator = GGNOperator(model, data, loss_fn, spec.params, precision=self.precision, chunk=self.chunk)
        self.spec, self.fisher_used = spec, fisher
        if self.uses_diagonal:
            self.diagonal, self.trace_from = self._diagonal(model, data, loss_fn, spec)
            self.mean_eigenvalue = float(self.diagonal.sum()) / spec.dim
        self._prepare()
        self.fit_products = self.operator.products

    def _diagonal(self, model: Any, data: Any, loss_fn: Any, spec: GradientSpec) -> tuple[Tensor, str]:
        """``diag(G)`` ``[P]`` and how it was obtained (``"stored gradients"``, ``"exact"`` or ``"true"``)."""
        if isinstance(self.operator, EmpiricalFisherOperator):
            return self.operator.diagonal(), "stored gradients"
        from ..curvature.fit import fit_curvature

        fitted = fit_curvature(model, data, loss_fn, spec=spec,
                               fit_options=FitOptions(kind="fisher", fisher="auto", max_dense=0, samples=self.samples,
                                                      seed=self.seed))
        diagonal = torch.cat([fitted.blocks[name].eigenvalues.reshape(-1) for name, _ in spec.params])
        return diagonal.to(self.operator.device, self.operator.dtype), fitted.fisher

    def _check_size(self, dim: int) -> None:
        """Refuse a model too large for the method before any pass over the data."""

    def _prepare(self) -> None:
        """Method-specific work at fit time (eigenpairs, dense matrix)."""

    @property
    def lam(self) -> float:
        if self.damping_mode == "absolute":
            return self.damping
        return self.damping * self.mean_eigenvalue

    # -- scoring -----------------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.operator is None:
            raise MissingStage(f"{self.name} needs curvature: run attr.fit(model, train_data, loss_fn) first "
                               "(or attr.fit() with fisher='empirical')")

    def bind(self, spec: GradientSpec) -> None:
        self.check_ready()
        if spec.params != self.spec.params or spec.projection != self.spec.projection:
            raise SpecMismatch(f"{self.name}: the curvature was fitted for other gradients (parameters or "
                               "projection differ); fit it on these")

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        self.check_ready()
        if queries.shape[1] != self.operator.dim:
            raise ValueError(f"{self.name}: query gradients of dim {queries.shape[1]}, the curvature covers "
                             f"{self.operator.dim}")
        if self.lam <= 0:
            raise CurvatureError(f"{self.name}: damping is {self.lam:g}; the Gauss-Newton matrix is singular in "
                                 "general, use damping > 0")
        solved = self._solve(queries.to(self.operator.device, self.operator.dtype))
        return solved.to(queries.device, torch.float32)

    def _solve(self, queries: Tensor) -> Tensor:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return {"fisher": self.fisher_used or self.fisher, "damping": self.damping, "damping_mode": self.damping_mode,
                "lambda": None if self.operator is None or self.mean_eigenvalue is None else self.lam,
                "mean_eigenvalue": self.mean_eigenvalue, "trace_from": self.trace_from, "precision": self.precision,
                "fit_products": self.fit_products}


@register_method
class Arnoldi(_WholeModel):
    """Arnoldi influence (Schioppa et al. 2022); see the module docstring.

    rank: eigenpairs kept; iterations: Arnoldi steps (default ``min(P, 2 * rank)``; each is one pass over the data);
    complement: what the complement of the top eigenspace is scaled by -- ``"mean"`` (default: ``1 / (lambda + m)``
    with ``m = (trace(G) - sum_k e_k) / (P - rank)`` the mean eigenvalue of the complement, from ``diag(G)``: the
    isotropic curvature with the complement's trace), ``"damping"`` (``1 / lambda``, the exact inverse of
    ``G_r + lambda I``: the complement treated as curvature 0, which weights directions of curvature up to
    ``e_rank`` up to ``e_rank / lambda`` times more than the exact inverse) or ``"zero"`` (dropped: the query
    projected onto the top eigenspace, Schioppa et al.'s definition); docs/quality.md measures all three;
    max_bytes: refuse when the Krylov basis and eigenvectors would take more memory than this.

    **Is the rank enough?** Fitting checks the spectrum it computed against the damping: when the smallest kept
    eigenvalue ``e_rank`` exceeds ``lambda``, directions whose curvature dominates the damping are left in the
    complement, where one scale (``1 / (lambda + m)``, ``1 / lambda`` or 0) replaces their ``1 / (e + lambda)``, and
    a ``RuntimeWarning`` says so, naming ``rank=`` (the rule: keep eigenvalues down to ``lambda``, i.e. a rank
    covering every eigenvalue above the damping), ``damping=`` and ``cg``. ``options()`` reports
    ``smallest_kept_over_lambda`` (``e_rank / lambda``) and ``discarded_trace_share`` (``1 - sum_k e_k /
    trace(G)``, the trace from ``diag(G)``). The trace share is reported, not tested: small discarded shares of the
    trace still leave eigenvalues far above ``lambda`` in the complement (docs/methods.md measures both).
    """

    name = "arnoldi"
    description = "Arnoldi influence: top eigenspace of the whole-model Gauss-Newton matrix (Schioppa et al. 2022)"

    def __init__(self, rank: int = 128, iterations: int | None = None, complement: str = "mean",
                 max_bytes: int = 4 << 30, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        count(rank, "arnoldi rank")
        if iterations is not None:
            count(iterations, "arnoldi iterations")
        count(max_bytes, "max_bytes")
        if complement not in ("damping", "mean", "zero"):
            raise ValueError(f"complement must be 'damping', 'mean' or 'zero', got {complement!r}")
        self.rank, self.iterations, self.complement, self.max_bytes = rank, iterations, complement, max_bytes
        self.eigenvalues: Tensor | None = None
        self.eigenvectors: Tensor | None = None
        self.tail_mean: float | None = None  # the complement's mean eigenvalue
        self.discarded_share: float | None = None  # 1 - sum_k e_k / trace(G)
        self.kept_over_lambda: float | None = None  # e_rank / lambda

    def _steps(self, dim: int) -> int:
        return self.iterations if self.iterations is not None else min(dim, 2 * self.rank)

    def _check_size(self, dim: int) -> None:
        if self.rank > dim:
            raise CurvatureError(f"arnoldi: rank {self.rank} exceeds the {dim:,} captured parameters; use "
                                 f"rank <= {dim}")
        steps = self._steps(dim)
        if not self.rank <= steps <= dim:
            raise CurvatureError(f"arnoldi: iterations must be between rank ({self.rank}) and the number of "
                                 f"parameters ({dim:,}), got {steps}")
        itemsize = 8 if self.precision == "float64" else 4
        need = arnoldi_bytes(steps, self.rank, dim, itemsize)
        if need > self.max_bytes:
            raise CurvatureError(
                f"arnoldi: rank {self.rank} with {steps} iterations over {dim:,} parameters needs "
                f"({steps} + 1 + {self.rank}) x {dim:,} x {itemsize} bytes = {human_bytes(need)} for the Krylov basis "
                f"and eigenvectors, more than max_bytes={human_bytes(self.max_bytes)}; lower rank= / iterations=, "
                "capture fewer layers, or use cg (memory: a few vectors per query)")

    def _prepare(self) -> None:
        op = self.operator
        self.eigenvalues, self.eigenvectors = arnoldi(op.matmul, op.dim, self.rank, self._steps(op.dim),
                                                      seed=self.seed, dtype=op.dtype, device=op.device)
        rest = op.dim - self.rank
        trace = float(self.diagonal.sum())
        tail = trace - float(self.eigenvalues.sum())
        self.tail_mean = max(tail, 0.0) / rest if rest > 0 else 0.0
        self.discarded_share = max(tail, 0.0) / trace if trace > 0 else 0.0
        lam, smallest = self.lam, float(self.eigenvalues[-1])
        self.kept_over_lambda = smallest / lam if lam > 0 else float("inf")
        if rest > 0 and smallest > lam:
            warnings.warn(
                f"arnoldi: rank {self.rank} stops at eigenvalue {smallest:.3g} = {self.kept_over_lambda:.3g} x "
                f"lambda ({lam:.3g}), so directions whose curvature exceeds the damping are left in the complement "
                f"(complement={self.complement!r}: one scale for all of them; {self.discarded_share:.1%} of "
                "trace(G) discarded) and the scores can be far from the exact influence; raise rank= (iterations >= "
                "rank) until the smallest kept eigenvalue is at most lambda, raise damping=, or use cg (exact to its "
                "tolerance)", RuntimeWarning, stacklevel=4)

    def _solve(self, queries: Tensor) -> Tensor:
        lam = self.lam
        coords = queries @ self.eigenvectors.t()  # [Q, r]
        if self.complement == "zero":
            return (coords / (self.eigenvalues + lam)) @ self.eigenvectors
        shift = lam + (self.tail_mean if self.complement == "mean" else 0.0)
        return queries / shift + (coords * (1 / (self.eigenvalues + lam) - 1 / shift)) @ self.eigenvectors

    def options(self) -> dict[str, Any]:
        steps = None if self.spec is None else self._steps(self.spec.dim)
        top = None if self.eigenvalues is None else [float(v) for v in self.eigenvalues[:3]]
        return {**super().options(), "rank": self.rank, "iterations": steps, "complement": self.complement,
                "top_eigenvalues": top, "complement_mean_eigenvalue": self.tail_mean,
                "smallest_kept_over_lambda": self.kept_over_lambda, "discarded_trace_share": self.discarded_share}


WHOLE_MODEL_DAMPING = 3.0
"""The default relative damping of ``cg`` and ``ggn_full`` (``lambda = 3 x trace(G) / P``): the best of the
candidates 0.001-10 by LDS averaged over the digits and digits_mlp tasks (``bench/whole_model_damping.py``, its
candidates fixed before its results: 0.1, the earlier default, 0.509; 3.0, 0.658; per-block ``ggn`` 0.592). The
whole-model Gauss-Newton matrix's mean eigenvalue is dominated by a few large directions; its many small ones are
noise for attribution, and a large damping keeps them from being amplified."""


@register_method
class ConjugateGradient(_WholeModel):
    """Conjugate-gradient influence; see the module docstring.

    tol: stop a query when its relative residual ``|r| / |g_q|`` is at most this; max_iter: iterations (each one
    pass over the data for the queries not yet converged; a warning names the queries that did not converge);
    preconditioner: ``"diagonal"`` (Jacobi: ``diag(G) + lambda``, default) or None.
    """

    name = "cg"
    description = "conjugate-gradient influence with whole-model Gauss-Newton-vector products"

    def __init__(self, tol: float = 1e-6, max_iter: int = 1000, preconditioner: str | None = "diagonal",
                 damping: float = WHOLE_MODEL_DAMPING, **kwargs: Any) -> None:
        super().__init__(damping=damping, **kwargs)
        if preconditioner not in ("diagonal", None):
            raise ValueError(f"preconditioner must be 'diagonal' or None, got {preconditioner!r}")
        at_least(tol, "cg tol", 0)
        count(max_iter, "cg max_iter")
        self.tol, self.max_iter, self.preconditioner = tol, max_iter, preconditioner
        self.last: dict[str, Any] = {}

    def _solve(self, queries: Tensor) -> Tensor:
        lam = self.lam
        diagonal = self.diagonal + lam if self.preconditioner == "diagonal" else None
        before = self.operator.products
        solution, iterations, residuals = conjugate_gradient(self.operator.matmul, queries, lam,
                                                             preconditioner=diagonal, tol=self.tol,
                                                             max_iter=self.max_iter)
        self.last = {"iterations": iterations, "products": self.operator.products - before,
                     "max_residual": float(residuals.max()) if residuals.numel() else 0.0}
        failed = int((residuals > self.tol).sum())
        if failed:
            warnings.warn(f"cg: {failed} of {len(residuals)} queries did not reach tol={self.tol:g} in "
                          f"{self.max_iter} iterations (worst relative residual {float(residuals.max()):.2e}); raise "
                          "max_iter= or damping=", RuntimeWarning, stacklevel=3)
        return solution

    def options(self) -> dict[str, Any]:
        return {**super().options(), "tol": self.tol, "max_iter": self.max_iter,
                "preconditioner": self.preconditioner, **self.last}


@register_method
class DenseGGN(_WholeModel):
    """Exact whole-model influence with the dense ``P x P`` Gauss-Newton / Fisher matrix (``P`` products with the
    identity, float64 eigendecomposition): the reference ``arnoldi`` and ``cg`` approximate. max_params: refuse
    larger models (the matrix and its eigenvectors take ``2 P^2`` float64 values)."""

    name = "ggn_full"
    description = "exact whole-model Gauss-Newton influence from the dense matrix (reference; small models)"
    uses_diagonal = False

    def __init__(self, max_params: int = 16384, damping: float = WHOLE_MODEL_DAMPING, **kwargs: Any) -> None:
        super().__init__(damping=damping, **kwargs)
        self.max_params = count(max_params, "max_params")
        self.values: Tensor | None = None
        self.vectors: Tensor | None = None

    def _check_size(self, dim: int) -> None:
        if dim > self.max_params:
            raise CurvatureError(f"ggn_full: the dense matrix of {dim:,} parameters needs 2 x {dim:,}^2 x 8 bytes = "
                                 f"{human_bytes(16 * dim * dim)} (matrix and eigenvectors, float64), beyond "
                                 f"max_params={self.max_params:,}; use arnoldi or cg")

    def _prepare(self) -> None:
        op = self.operator
        matrix = dense_matrix(op.matmul, op.dim, chunk=max(self.chunk, 256), device=op.device)
        self.trace_from = "dense matrix"
        self.mean_eigenvalue = float(torch.diagonal(matrix).sum()) / op.dim
        values, self.vectors = torch.linalg.eigh(matrix)
        self.values = values.clamp(min=0)

    def _solve(self, queries: Tensor) -> Tensor:
        rotated = queries.to(torch.float64) @ self.vectors
        return ((rotated / (self.values + self.lam)) @ self.vectors.t()).to(queries.dtype)
