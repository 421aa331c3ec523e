"""Online data selection: drop the examples of each step that hurt a target, by editing ``param.grad`` exactly.

``OnlineSelection`` is a capture callback. It collects the per-example gradients of the backward passes of an
optimizer step and, in a pre-hook of ``optimizer.step()``, scores every example against a target

* by default, the mean gradient of the step's own examples (drop examples that disagree with the batch),
* ``target=``: a fixed target gradient (a :class:`GradientBatch`, a :class:`GradientSet` / store row, or a flat
  vector laid out like the captured gradients), or
* ``validation=``: the mean gradient of a validation batch, taken through the same capture hooks (same
  layers, same loss convention) at the current weights,

with the cheap routes of :mod:`gradtrace.grad.ops` (no per-example weight-sized gradient is formed), drops the
chosen examples and subtracts exactly their contribution from ``param.grad`` -- so ``param.grad`` becomes the
gradient of the loop's loss over the kept examples only -- optionally renormalised to the mean over the kept
examples. Under DDP the dropped contributions are all-reduced (on every rank) before subtracting.

Selection rules (:class:`gradtrace.options.train.SelectionOptions`): ``rule="negative"`` (score < 0),
``rule="bottom", fraction=f`` (the lowest fraction ``f``), ``rule="threshold", threshold=x`` (score < x). At least
``min_keep`` examples are always kept (with a warning)::

    selector = OnlineSelection(optimizer, validation=val_batches,
                               options=SelectionOptions(rule="bottom", fraction=0.25, normalize=True))
    with gradtrace.capture(model, callbacks=[selector]) as cap:
        ...                                         # the loop, unchanged
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..capture.callbacks import CaptureCallback
from ..grad.batch import GradientBatch
from ..grad.ops import check_compatible, concat, dense_inner, sq_norms, weighted_sum
from ..options.train import SelectionOptions
from .cycle import Cycle

__all__ = ["OnlineSelection", "SelectionRecord"]


@dataclass
class SelectionRecord:
    """What one optimizer step dropped: step index, examples seen, dropped ids and every example's score."""

    step: int
    examples: int
    dropped: list[str]
    scores: dict[str, float] = field(default_factory=dict)


def _dist() -> tuple[bool, int]:
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    return ready, (torch.distributed.get_world_size() if ready else 1)


class OnlineSelection(CaptureCallback):
    """Drop harmful examples from every optimizer step (see module docstring).

    The target is the step's own mean gradient unless ``target`` or ``validation`` is given (not both).

    Args:
        optimizer: the loop's optimizer (selection runs in its step pre-hook).
        target: a fixed target gradient: a :class:`GradientBatch` or a :class:`GradientSet` / store (the mean of
            its rows), or a flat vector laid out like the captured gradients.
        validation: batches whose mean gradient, taken through the capture hooks at the current weights, is each
            step's target (re-iterated when exhausted).
        loss_fn: ``loss_fn(model, batch) -> [B]`` per-example losses of the ``validation`` batches (default:
            gradtrace's default loss for the batch's form); only with ``validation``.
        options: which examples are dropped and how ``param.grad`` is edited
            (:class:`gradtrace.options.train.SelectionOptions`; default: its defaults, the ``"negative"`` rule).

    Raises:
        ValueError: ``target`` and ``validation`` both given, or ``loss_fn`` without ``validation``.
        TypeError: ``options`` not a ``SelectionOptions``; ``target`` a string (the old mode names).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, target: Any = None,
                 validation: Iterable[Any] | None = None, loss_fn: Callable | None = None,
                 options: SelectionOptions | None = None) -> None:
        options = SelectionOptions() if options is None else options
        if not isinstance(options, SelectionOptions):
            raise TypeError(f"options= must be a SelectionOptions, got {type(options).__name__}")
        if target is not None and validation is not None:
            raise ValueError("pass target= (a fixed gradient) or validation= (batches), not both")
        if isinstance(target, str):
            raise TypeError(f"target= is a gradient, got the string {target!r}: the step's mean gradient is the "
                            "default, validation=<batches> targets a validation set")
        if loss_fn is not None and validation is None:
            raise ValueError("loss_fn= reads the validation batches: pass validation= too")
        self.optimizer = optimizer
        self.options = options
        self.target = target
        self.validation = validation
        self._validation = Cycle(validation if validation is not None else (), "validation batches")
        self.loss_fn = loss_fn
        self.history: list[SelectionRecord] = []
        self.capture = None
        self._pending: list[GradientBatch] = []
        self._handle = None
        self._steps = 0

    # -- capture callback --------------------------------------------------------------------------
    def on_capture_start(self, capture: Any) -> None:
        if capture.projection is not None:
            raise ValueError("online selection subtracts exact per-example contributions from param.grad: capture "
                             "without a projection")
        self.capture = capture
        self._params = _param_table(capture.model)
        self._handle = self.optimizer.register_step_pre_hook(self._before_step)

    def on_batch(self, batch: GradientBatch, capture: Any = None) -> None:
        self._pending.append(batch)

    def on_capture_end(self, capture: Any, error: BaseException | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending.clear()

    # -- the selection -----------------------------------------------------------------------------
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        batches, self._pending = self._pending, []
        step = self._steps
        self._steps += 1
        if not batches or step < self.options.start_step:
            return
        train = concat(batches) if len(batches) > 1 else batches[0]
        target = self._target_vectors(train)
        scores = dense_inner(train, target)  # [E]: <g_e, target>
        if self.options.normalize:
            target_norm = sum(float(v.double().pow(2).sum()) for v in target.values()) ** 0.5
            scores = scores / (sq_norms(train).clamp_min(1e-30).sqrt() * max(target_norm, 1e-30))
        drop = self._choose(scores)
        ready, world = self._ddp_state()
        kept_local = int((~drop).sum())
        if ready:
            kept = torch.tensor([kept_local], dtype=torch.long)
            torch.distributed.all_reduce(kept)
            kept_total = int(kept)
        else:
            kept_total = kept_local
        min_keep = self.options.min_keep
        if kept_total < min_keep:  # keep the best ones back (locally) rather than dropping everything
            order = torch.argsort(scores, descending=True)
            restore = order[: max(0, min_keep - kept_total)] if not ready else order[:1]
            drop[restore] = False
            warnings.warn(f"gradtrace selection: step {step} would drop every example; kept {len(restore)} "
                          "with the highest scores", stacklevel=2)
        weights = 1.0 / train.scale.to(torch.float64)  # each example's share of the loop's loss gradient
        self._subtract(train, weights * drop.to(torch.float64), weights, ready, world)
        ids = [train.ids[i] for i in drop.nonzero().flatten().tolist()]
        record = SelectionRecord(step, len(train), ids)
        if self.options.record_scores:
            record.scores = {ident: float(s) for ident, s in zip(train.ids, scores.tolist())}
        self.history.append(record)

    def _ddp_state(self) -> tuple[bool, int]:
        ready, world = _dist()
        if self.options.ddp is False:
            return False, 1
        return ready, world

    def _choose(self, scores: Tensor) -> Tensor:
        rule = self.options.rule
        if rule == "negative":
            return scores < 0
        if rule == "threshold":
            return scores < float(self.options.threshold)
        count = round(float(self.options.fraction) * scores.numel())
        drop = torch.zeros_like(scores, dtype=torch.bool)
        if count:
            drop[torch.argsort(scores)[:count]] = True
        return drop

    def _subtract(self, train: GradientBatch, drop_weights: Tensor, all_weights: Tensor, ready: bool,
                  world: int) -> None:
        dropped_share = float(drop_weights.sum())
        total_share = float(all_weights.sum())
        if ready:
            shares = torch.tensor([dropped_share, total_share], dtype=torch.float64)
            torch.distributed.all_reduce(shares)
            dropped_share, total_share = float(shares[0]), float(shares[1])
        for name, pg in train.params.items():
            param = self._params.get(name)
            if param is None or param.grad is None:
                continue
            removed = weighted_sum(pg, drop_weights.to(torch.float32)).to(param.grad.dtype).to(param.grad.device)
            if ready:  # DDP averaged the ranks' gradients: remove the average of the dropped contributions
                torch.distributed.all_reduce(removed)
                removed /= world
            param.grad.sub_(removed.reshape(param.grad.shape))
            if self.options.renormalize and total_share - dropped_share > 0:
                param.grad.mul_(total_share / (total_share - dropped_share))

    # -- targets -----------------------------------------------------------------------------------
    def _target_vectors(self, train: GradientBatch) -> dict[str, Tensor]:
        """The target gradient as dense per-parameter tensors laid out like ``train``'s parameters."""
        if self.target is not None:
            return _fixed_target(self.target, train)
        if self.validation is None:  # the step's own mean gradient
            weights = torch.full((len(train),), 1.0 / len(train))
            return {name: weighted_sum(pg, weights) for name, pg in train.params.items()}
        val = self._validation_batch()
        check_compatible(train, val, "selection target (validation gradients)")
        weights = torch.full((len(val),), 1.0 / len(val))
        return {name: weighted_sum(pg, weights) for name, pg in val.params.items()}

    def _validation_batch(self) -> GradientBatch:
        from ..common.batches import to_device
        from ..loss.functions import default_loss

        batch = self._validation.next()
        model = self.capture.model
        device = next(model.parameters()).device
        batch = to_device(batch, device)
        fn = self.loss_fn or default_loss(batch)
        with self.capture.side_pass() as side:
            losses = fn(model, {k: v for k, v in batch.items() if k != "id"} if isinstance(batch, dict) else batch)
            torch.autograd.grad(losses.sum(), self.capture.pop_outputs(), allow_unused=True)
        if not side.batches:
            raise RuntimeError("the validation pass captured no gradients")
        return concat(side.batches) if len(side.batches) > 1 else side.batches[0]


def _param_table(model: Any) -> dict[str, torch.nn.Parameter]:
    from ..common.modules import strip_wrappers, unwrap

    table = {}
    for name, param in unwrap(model).named_parameters():
        table.setdefault(strip_wrappers(name), param)
    return table


def _fixed_target(target: Any, train: GradientBatch) -> dict[str, Tensor]:
    if isinstance(target, GradientBatch):
        check_compatible(train, target, "selection target")
        weights = torch.full((len(target),), 1.0 / len(target))
        return {name: weighted_sum(pg, weights) for name, pg in target.params.items()}
    if hasattr(target, "spec") and hasattr(target, "read"):  # a GradientSet / store: the mean of its rows
        spec = target.spec
        if [(n, d) for n, d in spec.params] != list(train.dims.items()) or spec.projection != train.projection:
            raise ValueError("the selection target's gradients cover other parameters or another projection than "
                             "the captured ones")
        vector = target.read(0, len(target)).mean(0)
    elif isinstance(target, Tensor):
        vector = target.reshape(-1).to(torch.float32)
        if vector.numel() != sum(train.dims.values()):
            raise ValueError(f"the target vector has {vector.numel()} entries, the captured gradients "
                             f"{sum(train.dims.values())}")
    else:
        raise TypeError(f"unsupported selection target {type(target).__name__}")
    out, start = {}, 0
    for name, pg in train.params.items():
        out[name] = vector[start:start + pg.numel].reshape(pg.shape)
        start += pg.numel
    return out

