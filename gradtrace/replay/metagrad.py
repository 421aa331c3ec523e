"""Metagradients: the exact derivative of a query's final loss with respect to every training example's weight.

The recorded run is a function of the per-example data weights ``w`` (1 in the run itself):
``s_{t+1} = step_t(s_t, w_{B_t})``, ``s = (theta, optimizer buffers)``, each step's loss weighted as the loop
reduced it (:class:`gradtrace.replay.Reduction`). For a query loss ``L_q(theta_T)`` reverse mode gives
(REPLAY, Engstrom et al. 2025)::

    lambda_T = (dL_q/dtheta_T, 0)
    for t = T-1 .. 0:   dL_q/dw_{B_t} += lambda_{t+1} . d step_t / d w ;   lambda_t = lambda_{t+1} . d step_t / d s_t

Each vector-Jacobian product differentiates the gradient ``g_t`` itself (``create_graph=True``: a
Hessian-vector product through the loss) and the optimizer update (momentum, Adam's moments, clipping). The
states ``s_t`` are recomputed segment by segment from checkpoints every ``k`` steps (``k = ceil(sqrt(T))`` by
default: ``T/k + k`` states in memory, one extra forward replay). An example seen at several steps sums its
contributions. Scores follow the library's sign: ``score[q, i] = -dL_q/dw_i`` (> 0: up-weighting ``i`` lowers
the query loss, the example helps).

Queries are handled together: the cotangents carry a leading query axis and each reverse step is one batched
vector-Jacobian product (``torch.autograd.grad(..., is_grads_batched=True)``, a vmap over the backward pass);
``query_batch`` bounds how many go at once (1: one plain reverse pass per query).

``start_step = K`` truncates the pass (truncated back-propagation): the loop above stops after step ``K`` and
the cotangent of ``s_K`` is dropped, so the scores are the exact derivatives with respect to weights that act at
steps ``K .. T-1`` only -- for runs that are not metasmooth, where the cotangent grows step after step towards the
start of the run and the derivative through the early steps no longer predicts a finite change. When the run
recorded optimizer states (``RunRecorder(..., keep_states=N)``) the forward replay starts from the latest one at
or before ``K`` instead of from the initial weights.

After each segment the pass checks that it is finite and notes the norm of the parameters' cotangent (one host
read per segment, :mod:`gradtrace.replay.growth`): ``MetaGradients.growth``, and on an overflow an error that says
how fast the cotangent grew and whether float64 would reach the start of the run at that rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..options.base import option_object
from ..options.replay import MetagradOptions
from .checkpoints import CheckpointStore, default_interval
from .growth import Growth, merge, overflow_summary
from .optim import OptimState
from .replay import check_final
from .run import RecordedRun, load_run
from .spec import ReplayError
from .states import nearest_state
from .step import BatchFn, LossFn, StepFunction

__all__ = ["MetaGradients", "metagradients"]

QueryLossFn = Callable[[Callable[..., Any], Any], Tensor]
Key = tuple[str, ...]


@dataclass
class MetaGradients:
    """Scores of every training example for every query (``scores[q, i] = -dL_q / dw_i``)."""

    scores: Tensor  # [Q, N]
    ids: list[Any]  # the N training ids, the columns of scores
    query_losses: Tensor  # [Q]: L_q(theta_T)
    replay_difference: float | None  # the replay's relative difference to the recorded final weights
    checkpoint_every: int
    # (step, norm) from the end of the run (step T: the query gradients) to start_step, once per checkpoint segment: the
    # 2-norm of the cotangent of the parameters of s_step, the largest over the queries (how the reverse pass grows)
    growth: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0  # the first step differentiated (MetagradOptions.start_step; 0: the whole run)
    replayed_from: int = 0  # the step the forward replay started at: 0, or a state the run recorded (keep_states)


def _query_cotangents(steps: StepFunction, params: dict[str, Tensor], queries: Sequence[Any],
                      query_loss_fn: QueryLossFn) -> tuple[dict[Key, Tensor], Tensor]:
    """``dL_q/dtheta_T`` of each query, stacked ``[Q, ...]`` per parameter, and the losses ``[Q]``."""
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    forward, names = steps.forward(leaves), list(leaves)
    grads: dict[str, list[Tensor]] = {name: [] for name in names}
    losses = []
    for index, query in enumerate(queries):
        loss = query_loss_fn(forward, query)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ReplayError(f"query_loss_fn must return a scalar loss; query {index} gave "
                              f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}")
        got = torch.autograd.grad(loss.reshape(()), [leaves[n] for n in names], allow_unused=True)
        for name, g in zip(names, got):
            grads[name].append(torch.zeros_like(leaves[name]) if g is None else g)
        losses.append(loss.detach().reshape(()))
    return {("param", n): torch.stack(grads[n]) for n in names}, torch.stack(losses)


def reverse_step(steps: StepFunction, t: int, state: OptimState, cotangent: dict[Key, Tensor],
                 batched: bool) -> tuple[dict[Key, Tensor], list[Tensor | None]]:
    """Pull the cotangent of ``s_{t+1}`` back through step ``t``: the cotangent of ``s_t`` and ``dL/dw`` per
    micro-batch (``[Q, B_m]``, None where the weights do not reach the outputs)."""
    leaves = state.replace({key: t_.detach().requires_grad_(True) for key, t_ in state.tensors()})
    inputs = leaves.tensors()
    weights = [torch.ones(len(ids), dtype=inputs[0][1].dtype, device=inputs[0][1].device, requires_grad=True)
               for ids in steps.run.steps[t].micro_batches]
    new = steps.step(t, leaves, weights, create_graph=True)
    by_id = {id(tensor): key for key, tensor in inputs}
    passed: dict[Key, Tensor] = {}
    outputs, grad_outputs = [], []
    for key, tensor in new.tensors():
        cot = cotangent.get(key)
        if cot is None:
            continue
        if id(tensor) in by_id:  # untouched by the step (no gradient reached it): the identity
            passed[by_id[id(tensor)]] = cot
        elif tensor.requires_grad:
            outputs.append(tensor)
            grad_outputs.append(cot if batched else cot[0])
    sources = [tensor for _, tensor in inputs] + weights
    grads = (torch.autograd.grad(outputs, sources, grad_outputs, allow_unused=True, is_grads_batched=batched)
             if outputs else [None] * len(sources))
    if not batched:
        grads = [None if g is None else g.unsqueeze(0) for g in grads]
    previous: dict[Key, Tensor] = {}
    for (key, _), g in zip(inputs, grads[: len(inputs)]):
        total = passed.get(key)
        if g is not None:
            total = g if total is None else total + g
        if total is not None:
            previous[key] = total.detach()
    return previous, [None if g is None else g.detach() for g in grads[len(inputs):]]


def _columns(run: RecordedRun, train_ids: Sequence[Any] | None) -> tuple[list[Any], dict[Any, int]]:
    ids = list(train_ids) if train_ids is not None else run.example_ids()
    position = {ident: i for i, ident in enumerate(ids)}
    if len(position) != len(ids):
        raise ReplayError("train_ids holds duplicate ids")
    missing = [i for i in run.example_ids() if i not in position]
    if missing:
        raise ReplayError(f"{len(missing)} example id(s) of the run are not in train_ids, e.g. {missing[:5]}")
    return ids, position


def metagradients(run: RecordedRun | str | Path, model: torch.nn.Module, loss_fn: LossFn, batches: BatchFn,
                  queries: Sequence[Any], query_loss_fn: QueryLossFn, *, train_ids: Sequence[Any] | None = None,
                  options: MetagradOptions | None = None) -> MetaGradients:
    """Differentiate each query's final loss through every step of a recorded run w.r.t. the example weights.

    Args:
        run: a recorded run or its directory.
        model: a model with the recorded parameters (run functionally; its own values are not used).
        loss_fn: the training loss, ``loss_fn(forward, batch) -> losses [B]`` (or ``(losses, counts)``).
        batches: ``batches(ids) -> batch``.
        queries: the query objects, each passed to ``query_loss_fn``.
        query_loss_fn: ``query_loss_fn(forward, query) -> scalar`` at the final weights.
        train_ids: the columns of the scores (default: the run's ids in order of first appearance); must hold
            every id of the run.
        options: :class:`gradtrace.options.MetagradOptions` -- the first step differentiated (default 0: the
            whole run; ``K > 0`` truncates the pass), checkpoint spacing (default ``ceil(sqrt(T - K))``; the result
            does not depend on it), queries per reverse pass (default all, one vmapped pass), bytes of checkpoints
            kept in memory (the rest go to ``run_dir/metagrad_checkpoints_*/``, removed at the end), the replay
            check's bound (see :func:`gradtrace.replay.replay`).

    Returns:
        :class:`MetaGradients`: ``scores [Q, N] = -dL_q/dw_i`` and the query losses.

    Raises:
        ReplayError: a model that does not match, missing ids, a replay that does not reproduce the run, bad
            ``checkpoint_every`` / ``query_batch``, a ``start_step`` beyond the run.
    """
    options = option_object(options, MetagradOptions, "options")
    checkpoint_every, query_batch = options.checkpoint_every, options.query_batch
    memory_limit, tolerance = options.memory_limit, options.tolerance
    run = run if isinstance(run, RecordedRun) else load_run(run)
    steps = StepFunction(run, model, loss_fn, batches)
    total, first = len(run.steps), options.start_step
    if first and first >= total:
        raise ReplayError(f"start_step={first}: the run has {total} optimizer step(s), so the reverse pass would "
                          f"differentiate none; expected 0 <= start_step < {total}")
    every = checkpoint_every if checkpoint_every is not None else default_interval(total - first)
    if every < 1:
        raise ReplayError(f"checkpoint_every={every}: expected an int >= 1")
    if query_batch is not None and query_batch < 1:
        raise ReplayError(f"query_batch={query_batch}: expected an int >= 1")
    ids, position = _columns(run, train_ids)
    store = CheckpointStore(run.run_dir, memory_limit)
    begin = nearest_state(run.states, first)  # a truncated pass starts from the latest recorded state before it
    try:
        state = run.state(begin, steps.device) if begin else steps.initial_state()
        for t in range(begin, total):
            if t >= first and (t - first) % every == 0:
                store.put(t, state)
            state = steps.step(t, state)
        difference = check_final(run, state, tolerance)[0] if run.final is not None else None
        cotangents, query_losses = _query_cotangents(steps, state.params, queries, query_loss_fn)
        count = len(queries)
        chunk = query_batch or max(count, 1)
        dtype = query_losses.dtype
        dw = torch.zeros(count, len(ids), dtype=dtype, device=steps.device)
        traces = []
        for start in range(0, count, chunk):
            part = {key: c[start:start + chunk] for key, c in cotangents.items()}
            growth = Growth()
            dw[start:start + chunk] = _reverse(steps, store, first, every, part, chunk > 1, position, len(ids),
                                               growth)
            traces.append(growth.trace)
    finally:
        store.close()
    return MetaGradients(-dw, ids, query_losses, difference, every, merge(traces), first, begin)


def _reverse(steps: StepFunction, store: CheckpointStore, first: int, every: int, cotangent: dict[Key, Tensor],
             batched: bool, position: dict[Any, int], width: int, growth: Growth) -> Tensor:
    """One reverse pass over steps ``first .. T-1`` for a block of queries: ``dL_q/dw`` as ``[Q_block, N]``; the
    cotangent's norm at the end of the run and after each segment goes to ``growth``."""
    count = next(iter(cotangent.values())).shape[0]
    dtype, device = next(iter(cotangent.values())).dtype, steps.device
    dw = torch.zeros(count, width, dtype=dtype, device=device)
    total = len(steps.run.steps)
    growth.add(total, cotangent)
    for start in reversed(range(first, total, every)):
        segment = [store.get(start)]
        for t in range(start, min(start + every, total) - 1):
            segment.append(steps.step(t, segment[-1]))
        for t in reversed(range(start, min(start + every, total))):
            cotangent, weight_grads = reverse_step(steps, t, segment[t - start], cotangent, batched)
            for ids, grad in zip(steps.run.steps[t].micro_batches, weight_grads):
                if grad is not None:
                    index = torch.tensor([position[i] for i in ids], device=device)
                    dw.index_add_(1, index, grad.to(dtype))
        del segment
        growth.add(start, cotangent)
        _check_finite(cotangent, dw, start, min(start + every, total), total, first, growth)  # one host read
    return dw


def _check_finite(cotangent: dict[Key, Tensor], dw: Tensor, start: int, stop: int, total: int, first: int,
                  growth: Growth) -> None:
    """Raise :class:`ReplayError` when the reverse pass, after pulling the cotangents back through steps
    ``start .. stop - 1``, holds a NaN or inf (in a cotangent or in a weight's derivative); the error says how the
    cotangent grew (``growth``, read in the same host read) and carries the trace as its ``growth`` attribute."""
    finite = torch.stack([torch.isfinite(dw).all(), *(torch.isfinite(c).all() for c in cotangent.values())])
    if growth.read(finite.all())[0]:
        return
    queries = ~torch.isfinite(dw).all(dim=1)
    for c in cotangent.values():
        queries |= ~torch.isfinite(c.reshape(c.shape[0], -1)).all(dim=1)
    which = queries.nonzero().flatten().tolist()
    error = ReplayError(
        f"metagradients: the reverse pass overflowed (NaN/inf) between steps {start} and {stop - 1} of {total} "
        f"(counted from the start of the run) for {len(which)} of the {queries.numel()} queries of this pass (in "
        f"it: {which[:8]}): the derivative through the later steps grew beyond the dtype's range, which happens "
        "when the training run is not metasmooth (check it with gradtrace.replay.metasmoothness on a short "
        f"stretch). Growth: {overflow_summary(growth.trace, dw.dtype, start, stop, first)}. Replay in float64 "
        "(gradtrace metagrad --dtype float64, or the model and the recorded run cast to float64) to reach further, "
        f"truncate the pass to the later steps (start_step > {stop - 1}: they contribute exactly, the earlier ones "
        "not at all), or attribute with a method of gradtrace.fit")
    error.growth = growth.trace
    raise error
