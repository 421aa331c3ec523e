"""A metasmoothness check: how well the metagradients predict real re-runs along a random data-weight direction.

Metagradients are exact derivatives, but they are useful for attribution only where the training function
``w -> L_q(theta_T(w))`` is close to linear over the range of weights one cares about (dropping an example is
``w_i: 1 -> 0``). MAGIC (Ilyas & Engstrom 2025) calls this property *metasmoothness*. Along a random direction
``d`` (Rademacher, one entry per training example) and for each scale ``eps`` the check re-runs the recorded
steps with weights ``w = 1 + eps d`` (:func:`gradtrace.replay.replay` with ``weights=``) and compares

    actual[q]    = L_q(1 + eps d) - L_q(1)
    predicted[q] = eps * sum_i d_i dL_q/dw_i  =  -eps * scores[q] . d

by the relative error ``||actual - predicted|| / ||actual||`` and the fraction of queries whose sign agrees.
A smooth run shows an error that shrinks linearly with ``eps`` (the quadratic term) and full sign agreement.
For a truncated pass (``start_step = K``) the re-runs perturb the weights at steps ``K .. T-1`` only: the check
tests the function the scores are the derivative of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..options.base import option_object
from ..options.replay import MetagradOptions
from .metagrad import MetaGradients, QueryLossFn, metagradients
from .replay import replay
from .run import RecordedRun
from .step import BatchFn, LossFn, StepFunction

__all__ = ["SmoothnessReport", "metasmoothness"]


@dataclass
class SmoothnessReport:
    """Actual against linearly predicted changes of the query losses along one direction, per scale."""

    scales: list[float]
    actual: Tensor  # [E, Q]: L_q(1 + eps d) - L_q(1)
    predicted: Tensor  # [E, Q]: -eps * scores[q] . d
    relative_error: list[float]  # per scale
    sign_agreement: list[float]  # per scale: fraction of queries

    def table(self) -> str:
        """The report as a small text table."""
        lines = [f"{'eps':>10}{'rel. error':>12}{'sign agree':>12}"]
        lines += [f"{s:>10.1e}{e:>12.3e}{a:>12.2f}" for s, e, a in
                  zip(self.scales, self.relative_error, self.sign_agreement)]
        return "\n".join(lines)


def metasmoothness(run: RecordedRun, model: torch.nn.Module, loss_fn: LossFn, batches: BatchFn,
                   queries: Sequence[Any], query_loss_fn: QueryLossFn, *, result: MetaGradients | None = None,
                   options: MetagradOptions | None = None) -> SmoothnessReport:
    """Compare re-runs with weights ``1 + eps d`` (``d`` random +-1 per example) with the metagradient prediction.

    Args:
        run, model, loss_fn, batches, queries, query_loss_fn: as for :func:`gradtrace.replay.metagradients`.
        result: metagradients already computed for these queries (computed with ``options`` when None); the
            re-runs perturb the weights from its ``start_step`` on.
        options: :class:`gradtrace.options.MetagradOptions`: ``scales`` (the step sizes ``eps`` along ``d``) and
            ``seed`` (the seed of ``d``), and the metagradients' settings.

    Returns:
        the :class:`SmoothnessReport`.
    """
    options = option_object(options, MetagradOptions, "options")
    scales = options.scales
    if result is None:
        result = metagradients(run, model, loss_fn, batches, queries, query_loss_fn, options=options)
    gen = torch.Generator().manual_seed(options.seed)
    direction = torch.randint(0, 2, (len(result.ids),), generator=gen).to(torch.float64) * 2 - 1  # [N]
    slope = -(result.scores.to(torch.float64) @ direction)  # [Q]: d/d eps of L_q(1 + eps d)
    steps = StepFunction(run, model, loss_fn, batches)
    actual, predicted, errors, agree = [], [], [], []
    for eps in scales:
        weights = {ident: 1.0 + eps * float(d) for ident, d in zip(result.ids, direction)}
        state = replay(run, model, loss_fn, batches, weights=weights, weights_from=result.start_step).state
        forward = steps.forward(state.params)
        with torch.no_grad():
            losses = torch.stack([query_loss_fn(forward, q).reshape(()).to(torch.float64) for q in queries])
        change, linear = losses - result.query_losses.to(torch.float64), eps * slope
        actual.append(change)
        predicted.append(linear)
        errors.append(((change - linear).norm() / change.norm().clamp(min=1e-300)).item())
        agree.append((torch.sign(change) == torch.sign(linear)).to(torch.float64).mean().item())
    return SmoothnessReport(list(scales), torch.stack(actual), torch.stack(predicted), errors, agree)
