"""Replaying a recorded run functionally, and checking that it lands on the recorded final weights.

``replay(run, model, loss_fn, batches)`` runs every recorded step with :class:`~gradtrace.replay.step.StepFunction`
(``torch.func.functional_call`` over the user's model, the functional optimizer of
:mod:`gradtrace.replay.optim`) and compares the result with ``final.safetensors``. The difference is
``max_k |theta_k - theta_k^rec| / max(1, max_k |theta_k^rec|)`` over every optimized parameter; beyond the bound
(:data:`DEFAULT_TOLERANCE` by dtype) the replay is refused, with the measured difference: metagradients of a
run the replay does not reproduce would be the derivatives of another run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .optim import OptimState
from .run import RecordedRun
from .spec import ReplayError
from .states import nearest_state
from .step import BatchFn, LossFn, StepFunction

__all__ = ["DEFAULT_TOLERANCE", "ReplayResult", "check_final", "final_difference", "replay"]

# relative bound on the final weights by parameter dtype: bit-identical is expected on the CPU with the
# single-tensor optimizers; the bounds leave room for other kernels (foreach, GPU reductions) over a short run
DEFAULT_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass
class ReplayResult:
    """A replayed run: its final state, and how far it is from the recorded final weights."""

    state: OptimState
    difference: float | None  # relative max-abs difference to the recorded final weights (None: not recorded)
    tolerance: float | None


def final_difference(run: RecordedRun, state: OptimState) -> float:
    """``max |theta - theta^rec| / max(1, max |theta^rec|)`` over the optimized parameters.

    Raises:
        ReplayError: the run has no final weights.
    """
    if run.final is None:
        raise ReplayError(f"{run.run_dir}: no final weights to compare with")
    diff, scale = 0.0, 1.0
    for name, param in state.params.items():
        recorded = run.final[name].to(param.device, param.dtype)
        diff = max(diff, (param.detach() - recorded).abs().max().item() if param.numel() else 0.0)
        scale = max(scale, recorded.abs().max().item() if param.numel() else 0.0)
    return diff / scale


def replay(run: RecordedRun, model: torch.nn.Module, loss_fn: LossFn, batches: BatchFn, *,
           check: bool = True, tolerance: float | None = None,
           weights: Mapping[Any, float] | None = None, weights_from: int = 0) -> ReplayResult:
    """Run the recorded steps again and (``check``) compare with the recorded final weights.

    With ``weights`` (example id -> weight ``w_i``, 1 for the ids left out) it runs the counterfactual instead:
    the same steps with each example's loss weighted, ``sum_i w_i l_i / D``; no check then.

    Args:
        run: the recorded run (:func:`gradtrace.replay.load_run`).
        model: a model with the recorded parameters.
        loss_fn: ``loss_fn(forward, batch) -> losses [B]`` (or ``(losses, counts)`` for a token mean).
        batches: ``batches(ids) -> batch``.
        check: compare with the recorded final weights and refuse beyond ``tolerance``.
        tolerance: the relative bound (default: :data:`DEFAULT_TOLERANCE` for the parameters' dtype).
        weights: per-example weights of a counterfactual run (None: the recorded run).
        weights_from: the first step ``weights`` act at (the steps before it run with weights 1): the
            counterfactual a truncated reverse pass models (``MetagradOptions.start_step``). With ``weights`` the
            replay starts from the latest state the run recorded at or before it (``keep_states``), if any.

    Returns:
        the final state and the measured difference.

    Raises:
        ReplayError: a model that does not match, missing ids, or a replay beyond the bound.
    """
    steps = StepFunction(run, model, loss_fn, batches)
    begin = nearest_state(run.states, weights_from) if weights is not None else 0
    state = run.state(begin, steps.device) if begin else steps.initial_state()
    for t in range(begin, len(run.steps)):
        state = steps.step(t, state, steps.weights_at(t, weights) if weights is not None and t >= weights_from
                           else None)
    if not check or run.final is None or weights is not None:
        return ReplayResult(state, None, None)
    difference, bound = check_final(run, state, tolerance)
    return ReplayResult(state, difference, bound)


def check_final(run: RecordedRun, state: OptimState, tolerance: float | None = None) -> tuple[float, float]:
    """Compare a replayed final state with the recorded final weights.

    Returns:
        the relative difference (:func:`final_difference`) and the bound it was held to.

    Raises:
        ReplayError: a difference beyond ``tolerance`` (default :data:`DEFAULT_TOLERANCE` for the dtype).
    """
    dtype = next(iter(state.params.values())).dtype
    bound = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, 1e-4)
    difference = final_difference(run, state)
    if not difference <= bound:
        raise ReplayError(f"the replay does not reproduce the recorded run: final weights differ by {difference:.3e}"
                          f" (relative max-abs), bound {bound:.1e}; check that loss_fn, batches(ids), the reduction,"
                          " clipping and accumulation are those of the recorded loop")
    return difference, bound
