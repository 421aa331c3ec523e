"""Unrolled influence over checkpoints of one run: the training trajectory's linear response, segment by segment.

An influence function asks how the *optimum* moves when an example is down-weighted; a model stopped before
convergence, or trained in stages, is not at that optimum. Unrolling asks how the *trajectory* moves instead. Split
training at ``C`` checkpoints into segments ``c = 1..C`` (segment ``c``: the ``K_c`` optimizer steps up to
checkpoint ``c``, mean learning rate ``eta_c``; the last checkpoint is the attributed model) and take, within each
segment, the curvature ``G_c`` (fitted at checkpoint ``c``, with its damping ``lambda_c``) and the training
gradients ``g_i^(c)`` (collected at checkpoint ``c``) as constant. Down-weighting example ``i`` by ``eps`` in a step
of size ``eta s`` (``s`` the optimizer's per-coordinate step scale: 1 for SGD) changes the parameters by
``eps eta s g_i / N`` and every later step contracts that change by ``I - eta s H``; summed over a segment (a
geometric series, written as its continuous-time limit) and carried through the later segments:

    d theta_T / d eps = 1/N sum_c  E_C ... E_{c+1} F_c g_i^(c)
    F_c = (I - exp(-t_c (G_c + lambda_c))) (G_c + lambda_c)^-1,    E_c = exp(-t_c (G_c + lambda_c)),
    t_c = eta_c K_c s_c,

and the score of training example ``i`` for query ``q`` (its gradient ``g_q`` at the attributed model) is

    tau(q, i) = sum_c (F_c u_c)^T g_i^(c),    u_C = g_q,   u_c = E_{c+1} u_{c+1}.

Each ``F_c`` and ``E_c`` is a function of one member's curvature, applied in its eigenbasis
(:meth:`gradtrace.fit.curvature.Curvature.apply_function`), so the cost is the ensemble's: one fit and one store per
checkpoint; the query side is ``2 C - 1`` eigenbasis transforms of the query gradients, the training side ``C``
streamed products. There is no per-member normalisation and no weight to choose: the dynamics weigh the members.
High-curvature directions are learned (and forgotten) within a segment, so there the last checkpoint's
``(G + lambda)^-1`` dominates; flat directions keep a memory of every segment, weighted by its ``eta K``.

Limits (each a test): one segment with ``t -> inf`` is the member's own damped influence ``(G + lambda)^-1``;
``t -> 0`` is TracIn's ``eta K g_q^T g_i``; on a quadratic, with exact curvature, the scores equal the derivative of
gradient descent's final loss through the unrolled steps (up to the geometric series' continuous-time limit).

**The optimizer.** SGD: ``s = 1``. Adam / AdamW: a step is ``eta m_hat / (sqrt(v_hat) + eps)``, a diagonal
preconditioner ``P = diag(1 / (sqrt(v_hat) + eps))`` read from the optimizer state at each checkpoint (bias-corrected
as Adam's update). ``P`` does not commute with the curvature's eigenbasis, so each curvature block takes one scalar
``s_{c,b}``, chosen by ``step_scale``:

* ``"trace"`` (default): ``s = tr(P V) / tr(V) = sum_j v_j / (sqrt(v_j) + eps) / sum_j v_j`` with ``V = diag(v_hat)``,
  Adam's own estimate of the gradients' second moment (a proxy of the curvature's diagonal): the scalar that keeps
  the total contraction rate ``tr(P H)`` of the block, and the least-squares fit of ``P`` on the coordinates
  weighted by how much gradient they carry. A block whose second moment is all zero never moved: ``s = 0``.
* ``"eigenbasis"``: one scale per eigen-direction ``k`` of the block instead of one per block: the diagonal of ``P``
  in the curvature's eigenbasis, ``s_k = q_k^T P q_k`` (for a Kronecker basis ``(Q_R^2)^T P (Q_C^2)``, ``P`` laid out
  as the block's gradient matrix; on a LoGra store ``P`` from Adam's second moment mapped into the projection, as
  ``trackstar`` maps it), so ``P H ~ Q diag(s * Lambda) Q^T``. Adam gives flat directions, whose coordinates get
  small gradients, large steps; a block's single scale cannot.
* ``"mean"``: the plain mean of ``P`` over the block's coordinates. Coordinates that receive (almost) no gradient
  -- position embeddings of unused positions, a vocabulary's unseen tokens -- have ``P ~ 1 / eps`` and decide it
  (on ``tinylm``, ``t`` of 10^4-10^5 for whole layers, a step size no coordinate that learns takes); kept for
  comparison: it was the first definition benchmarked (docs/quality.md).

Adam's momentum leaves the response of directions slower than its horizon unchanged and is not modelled, nor is
weight decay (``lambda_c`` stands in for it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..capture.gradient_set import as_source
from ..common.checkpoints import checkpoint_path
from ..fit.curvature.curvature import KronEigen, kron_matrices
from ..fit.methods import Method, MissingStage
from ..fit.methods.less import adam_states
from ..fit.methods.trackstar import (
    bias_corrected,
    load_optimizer_state,
    optimizer_parameter_names,
    second_moment_denominator,
)
from .engine import _check_prepared
from .ensemble import Ensemble, EnsembleError, is_member_list
from .scores import Scores

__all__ = ["STEP_SCALES", "Unrolled", "segment_scales"]

SGD = "sgd"


def _schedule(values: float | Sequence[float], count: int, what: str, integer: bool = False) -> list[float]:
    """One positive finite value per segment (a single number: the same for every segment)."""
    items = [values] * count if isinstance(values, (int, float)) else list(values)
    if len(items) != count:
        raise EnsembleError(f"{len(items)} values of {what} for {count} checkpoints: give one per segment (the "
                            "steps up to each checkpoint from the one before)")
    out = []
    for c, value in enumerate(items):
        number = float(value)
        if not math.isfinite(number) or number <= 0 or (integer and number != int(number)):
            kind = "a positive integer" if integer else "positive and finite"
            raise EnsembleError(f"{what} of segment {c} must be {kind}, got {value!r}")
        out.append(number)
    return out


STEP_SCALES = ("trace", "eigenbasis", "mean")


def segment_scales(curvature: Any, states: dict[str, Any] | None, step_scale: str = "trace"
                   ) -> dict[str, float | Tensor]:
    """``{block name: s}``: the optimizer's step scale over each block of ``curvature`` (a fitted
    :class:`~gradtrace.fit.Curvature`; module docstring) from Adam states
    (:func:`~gradtrace.fit.methods.less.adam_states`), ``P = 1 / (sqrt(v_hat) + eps)``, ``V = v_hat``:
    ``tr(P V) / tr(V)`` (``"trace"``), ``mean(P)`` (``"mean"``) or, per eigen-direction (a tensor shaped like the
    block's eigenvalues), ``diag(Q^T P Q)`` (``"eigenbasis"``); 1 for SGD (``states=None``)."""
    if step_scale not in STEP_SCALES:
        raise ValueError(f"step_scale must be one of {STEP_SCALES}, got {step_scale!r}")
    blocks = list(curvature.blocks.values())
    if states is None:
        return {eig.block.name: 1.0 for eig in blocks}
    bad = [p for eig in blocks for p in eig.block.params if not bool(torch.isfinite(bias_corrected(states[p])).all())]
    if bad:
        raise ValueError(f"the Adam second moment (exp_avg_sq) of {bad[:3]} holds NaN/inf")
    if step_scale == "eigenbasis":
        eps = next(iter(states.values())).eps
        steps = 1.0 / second_moment_denominator(curvature.spec, states, eps).to(torch.float64)
        offsets = curvature.spec.offsets()
        return {eig.block.name: _eigen_diagonal(eig, steps, offsets) for eig in blocks}
    scales = {}
    for eig in blocks:
        weighted, weight, total, count = 0.0, 0.0, 0.0, 0
        for name in eig.block.params:
            state = states[name]
            moment = bias_corrected(state).clamp(min=0).to(torch.float64)
            step = 1.0 / (moment.sqrt() + state.eps)
            weighted += float((moment * step).sum())
            weight += float(moment.sum())
            total += float(step.sum())
            count += step.numel()
        if step_scale == "mean":
            scales[eig.block.name] = total / count
        else:
            scales[eig.block.name] = weighted / weight if weight > 0 else 0.0
    return scales


def _eigen_diagonal(eig: Any, diagonal: Tensor, offsets: dict[str, tuple[int, int]]) -> Tensor:
    """``diag(Q^T diag(p) Q)`` for one block's eigenbasis ``Q`` and a diagonal ``p`` laid out as the spec (``[D]``),
    shaped like the block's eigenvalues (float64)."""
    block = eig.block
    if isinstance(eig, KronEigen):
        matrix = kron_matrices(diagonal[None], block, offsets)[0]
        if eig.q_rows is not None:
            matrix = eig.q_rows.to(torch.float64).square().t() @ matrix
        if eig.q_cols is not None:
            matrix = matrix @ eig.q_cols.to(torch.float64).square()
        return matrix
    start, stop = offsets[block.name]
    part = diagonal[start:stop]
    return part if eig.q is None else eig.q.to(torch.float64).square().t() @ part


def _filters(curvature: Any, horizon: dict[str, float | Tensor]) -> tuple[Any, Any]:
    """The functions of one segment's damped eigenvalues ``x`` (float64) for
    :meth:`~gradtrace.fit.curvature.Curvature.apply_function`: the response ``(1 - exp(-t x)) / x`` (``expm1``: exact
    for small ``t x``) and the decay ``exp(-t x)``, ``t`` the block's horizon (a number, or one per eigenvalue)."""

    def damped(name: str, values: Tensor) -> Tensor:
        return values.to(torch.float64) + curvature.block_damping(name)

    def response(name: str, values: Tensor) -> Tensor:
        shifted = damped(name, values)
        return (-torch.expm1(-horizon[name] * shifted) / shifted).to(torch.float32)

    def decay(name: str, values: Tensor) -> Tensor:
        return torch.exp(-horizon[name] * damped(name, values)).to(torch.float32)

    return response, decay


class Unrolled(Ensemble):
    """Unrolled influence over the checkpoints of one training run (see the module docstring).

    Args:
        method: a curvature method (``"ekfac"`` (default), ``"kfac"``, ``"ggn"``, ``"logra"`` with a model-pass mode)
            fitted at every checkpoint; its damping is ``lambda_c``.
        train: one training-gradient source per checkpoint, in training order; the last is the attributed model.
        steps: the optimizer steps of each segment (up to its checkpoint from the one before; the first from the
            start of training), one per checkpoint.
        lr: each segment's mean learning rate (one number: constant).
        step_scale: how an Adam state becomes step scales: one per curvature block, ``"trace"`` (default) or
            ``"mean"``, or one per eigen-direction, ``"eigenbasis"`` (module docstring).
        block_rows, device, matrix_bytes, **method_options: as for :class:`~gradtrace.Ensemble`.
    """

    def __init__(self, method: str | Method | Sequence[Method] = "ekfac", train: Any = None, *,
                 steps: Sequence[int], lr: float | Sequence[float], step_scale: str = "trace",
                 block_rows: int | None = None,
                 device: torch.device | str | None = None, matrix_bytes: int = 2**30, **method_options: Any) -> None:
        super().__init__(method, train, normalize=False, block_rows=block_rows, device=device,
                         matrix_bytes=matrix_bytes, **method_options)
        if not hasattr(self.method, "active"):
            raise EnsembleError(f"unrolled influence needs a curvature method (ekfac, kfac, ggn, logra), got "
                                f"{self.method.name!r}")
        count = len(self.members)
        self.steps = _schedule(steps, count, "steps", integer=True)
        self.lr = _schedule(lr, count, "lr")
        if step_scale not in STEP_SCALES:
            raise EnsembleError(f"step_scale must be one of {STEP_SCALES}, got {step_scale!r}")
        self.step_scale = step_scale
        self.scales: list[dict[str, float | Tensor]] | None = None
        self.optimizer_kind: str | None = None

    def fit(self, model: nn.Module | None = None, data: Any = None, loss_fn: Any = None, *,
            models: Sequence[nn.Module] | None = None, checkpoints: Sequence[Any] | None = None,
            optimizers: str | Sequence[Any] | None = None, param_names: Sequence[Sequence[str] | None] | None = None,
            **options: Any) -> Unrolled:
        """Fit the curvature at every checkpoint (as :meth:`Ensemble.fit`: ``models=`` or ``checkpoints=``) and read
        each segment's step scale.

        Without a model, data or checkpoints, the members keep the curvature they were built with
        (``Unrolled([gradtrace.fit.methods.EKFAC(curvature=...), ...], ...)``) and only the step scales are read.

        Args:
            optimizers: ``"sgd"`` (plain SGD: scale 1), or one Adam / AdamW state per checkpoint (the optimizer, its
                ``state_dict()``, or a path to its ``optimizer.pt`` / the checkpoint directory holding it); default:
                each checkpoint directory's ``optimizer.pt`` (a Trainer ``checkpoint-N``).
            param_names: per checkpoint, the names of its optimizer's parameters in order (default: those its
                store records, as for ``trackstar``).
            model, data, loss_fn, models, checkpoints, **options: as for :meth:`Ensemble.fit`.
        """
        count = len(self.members)
        states = self._optimizer_states(optimizers, checkpoints, count)
        names = [None] * count if param_names is None else list(param_names)
        if len(names) != count:
            raise EnsembleError(f"{len(names)} param_names lists for {count} checkpoints: give one per checkpoint")
        if any(given is not None for given in (model, data, models, checkpoints)):
            super().fit(model, data, loss_fn, models=models, checkpoints=checkpoints, **options)
        self.combined.check_ready()  # members built with their curvature need no model pass
        scales = []
        for c, (member, state) in enumerate(zip(self.members, states)):
            curvature = member.method.active()
            if state is None:
                scales.append(segment_scales(curvature, None))
                continue
            owner = models[c] if models is not None else model
            if owner is None:
                raise MissingStage("unrolled: reading Adam states needs the model (to match the optimizer's "
                                   "parameters): fit(model, data, loss_fn, checkpoints=[...]) or models=[...]")
            recorded = optimizer_parameter_names(names[c], member.train[0], state)
            params = [name for name, _ in curvature.spec.params]
            found = adam_states(owner, load_optimizer_state(state), params, param_names=recorded)
            try:
                scales.append(segment_scales(curvature, found, self.step_scale))
            except ValueError as err:
                raise EnsembleError(f"unrolled: checkpoint {c}: {err}; check its optimizer state") from None
        self.scales = scales
        self.optimizer_kind = SGD if all(s is None for s in states) else "adam"
        return self

    @staticmethod
    def _optimizer_states(optimizers: Any, checkpoints: Sequence[Any] | None, count: int) -> list[Any]:
        """One optimizer state per checkpoint (None: SGD), from ``optimizers`` or the checkpoint directories."""
        if isinstance(optimizers, str) and optimizers == SGD:
            return [None] * count
        if optimizers is not None:
            if isinstance(optimizers, (str, Path)) or not isinstance(optimizers, Sequence):
                raise EnsembleError("optimizers= is 'sgd' or a list of one Adam state per checkpoint (each checkpoint "
                                    "has its own second moment)")
            if len(optimizers) != count:
                raise EnsembleError(f"{len(optimizers)} optimizer states for {count} checkpoints: give one per "
                                    "checkpoint")
            return list(optimizers)
        paths = [checkpoint_path(c) for c in checkpoints] if checkpoints is not None else []
        if len(paths) == count and all(p is not None and (p / "optimizer.pt").is_file() for p in paths):
            return paths
        raise MissingStage("unrolled: how the optimizer stepped is needed: optimizers='sgd' for plain SGD, or "
                           "optimizers=[...] with the Adam state at each checkpoint (optimizer, state_dict() or "
                           "optimizer.pt), or checkpoints=[...] as Trainer checkpoint directories holding optimizer.pt")

    def horizons(self) -> list[dict[str, float | Tensor]]:
        """``t_{c,b} = eta_c K_c s_{c,b}`` of every segment ``c`` and curvature block ``b`` (with
        ``step_scale="eigenbasis"``, a tensor: one per eigen-direction)."""
        if self.scales is None:
            raise MissingStage("unrolled: run fit(...) first (the curvature and step scale of every checkpoint)")
        return [{name: lr * steps * s for name, s in scales.items()}
                for lr, steps, scales in zip(self.lr, self.steps, self.scales)]

    def prepare(self, queries: Tensor) -> list[Tensor]:
        """``[Q, D]`` query gradients at the attributed model -> ``F_c u_c`` for every checkpoint ``c``."""
        horizons = self.horizons()
        prepared: list[Tensor] = [queries] * len(self.members)
        carried = queries.to(torch.float32)
        for c in range(len(self.members) - 1, -1, -1):
            curvature = self.members[c].method.active()
            response, decay = _filters(curvature, horizons[c])
            prepared[c] = curvature.apply_function(carried, response)
            if c > 0:
                carried = curvature.apply_function(carried, decay)
        return prepared

    def score(self, queries: Any, *, topk: int | None = 100, matrix: bool | str = "auto",
              progress: bool = False) -> Scores:
        """Score query gradients taken at the attributed model (the last checkpoint) against every training example.

        Args:
            queries: one query-gradient source (store, path, :class:`~gradtrace.GradientSet`, batches).
            topk, matrix, progress: as for :meth:`gradtrace.Attributor.score`.
        """
        if is_member_list(queries):
            raise EnsembleError("unrolled influence takes one query set, at the attributed model (the last "
                                "checkpoint): the later segments carry the query back to the earlier ones")
        source = as_source(queries)
        started = time.perf_counter()
        self.combined.check_ready()
        self.combined.bind(self.spec)
        last = self.members[-1]
        last.spec.check_compatible(source.spec, "queries vs training gradients (the last checkpoint)")
        prepared = self.prepare(source.read(0, len(source), last.device).to(torch.float32))
        prepared_s = time.perf_counter() - started
        for c, part in enumerate(prepared):
            _check_prepared(part, source.ids, f"unrolled {self.method.name}", c)
        self.combined.factors = [1.0] * len(self.members)
        self.combined.prepared = prepared
        try:
            scores = self.engine.score([source] * len(self.members), topk=topk, matrix=matrix, progress=progress)
        finally:
            self.combined.prepared = None
        self.profile = {**scores.meta["profile"], "prepare_queries_s": prepared_s}
        scores.meta["profile"] = dict(self.profile)
        scores.meta["unrolled"] = {"checkpoints": len(self.members), "steps": self.steps, "lr": self.lr,
                                   "optimizer": self.optimizer_kind, "step_scale": self.step_scale,
                                   "horizons": [{name: float(torch.as_tensor(t, dtype=torch.float64).mean())
                                                 for name, t in h.items()} for h in self.horizons()],
                                   "member_options": [m.method.options() for m in self.members]}
        return scores

    def __repr__(self) -> str:
        return f"Unrolled({self.method.name!r}, {len(self.members)} checkpoints, steps={self.steps}, lr={self.lr})"
