"""Online data selection: drop the examples of each step that hurt a target, by editing ``param.grad`` exactly.

``OnlineSelection`` is a capture callback. It collects the per-example gradients of the backward passes of an
optimizer step and, in a pre-hook of ``optimizer.step()``, scores every example against a target

* ``"batch"`` -- the mean gradient of the step's own examples (drop examples that disagree with the batch),
* a fixed target gradient (a :class:`GradientBatch`, a :class:`GradientSet` / store row, or a flat vector laid out
  like the captured gradients), or
* ``"validation"`` -- the mean gradient of a validation batch, taken through the same capture hooks (same
  layers, same loss convention) at the current weights,

with the cheap routes of :mod:`gradtrace.grad.ops` (no per-example weight-sized gradient is formed), drops the
chosen examples and subtracts exactly their contribution from ``param.grad`` -- so ``param.grad`` becomes the
gradient of the loop's loss over the kept examples only -- optionally renormalised to the mean over the kept
examples. Under DDP the dropped contributions are all-reduced (on every rank) before subtracting.

Selection rules: ``"negative"`` (score < 0), ``("bottom", f)`` (the lowest fraction ``f``), ``("threshold", x)``
(score < x). At least ``min_keep`` examples are always kept (with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..capture.callbacks import CaptureCallback
from ..common.checks import count, fraction
from ..grad.batch import GradientBatch
from ..grad.ops import check_compatible, concat, dense_inner, sq_norms, weighted_sum
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

    Args:
        optimizer: the loop's optimizer (selection runs in its step pre-hook).
        target: ``"batch"``, ``"validation"``, or a fixed target gradient.
        rule: ``"negative"``, ``("bottom", fraction)`` or ``("threshold", value)``.
        validation: batches for ``target="validation"`` (re-iterated when exhausted); ``loss_fn(model, batch)``
            returns their per-example losses (default: gradtrace's default loss for the batch's form).
        renormalize: rescale ``param.grad`` to the mean over kept examples (for a mean-reduced loop loss).
        normalize: score by cosine similarity (``<g_e, target> / (|g_e| |target|)``) instead of the inner
            product, so that examples with large gradients (high loss) do not dominate the ranking; the sign, and
            so the ``"negative"`` rule, is unchanged.
        min_keep: examples always kept per step (across ranks under DDP).
        start_step: optimizer steps to leave alone before selecting (early in training, while a model learns
            token frequencies or class priors, even corrupted examples can point along the target).
        record_scores: keep every example's score in the log (``history``).
        ddp: all-reduce the dropped contributions (default: when a process group is initialised).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, target: Any = "batch", rule: Any = "negative",
                 validation: Iterable[Any] | None = None, loss_fn: Callable | None = None, renormalize: bool = False,
                 normalize: bool = False, min_keep: int = 1, start_step: int = 0, record_scores: bool = False,
                 ddp: bool | None = None) -> None:
        if isinstance(target, str) and target not in ("batch", "validation"):
            raise ValueError(f"target must be 'batch', 'validation' or a gradient, got {target!r}")
        if target == "validation" and validation is None:
            raise ValueError("target='validation' needs validation=<batches>")
        self._check_rule(rule)
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative integer, got {start_step!r}")
        self.optimizer = optimizer
        self.target = target
        self.rule = rule
        self.validation = validation
        self._validation = Cycle(validation if validation is not None else (), "validation batches")
        self.loss_fn = loss_fn
        self.renormalize = renormalize
        self.normalize = normalize
        self.min_keep = count(min_keep, "min_keep", minimum=0)
        self.start_step = start_step
        self.record_scores = record_scores
        self.ddp = ddp
        self.history: list[SelectionRecord] = []
        self.capture = None
        self._pending: list[GradientBatch] = []
        self._handle = None
        self._steps = 0

    @staticmethod
    def _check_rule(rule: Any) -> None:
        if rule == "negative":
            return
        if isinstance(rule, tuple) and len(rule) == 2 and rule[0] in ("bottom", "threshold"):
            if rule[0] == "bottom":
                fraction(rule[1], f"the bottom value of rule={rule!r}")
            elif not isinstance(rule[1], (int, float)) or isinstance(rule[1], bool) or rule[1] != rule[1]:
                raise ValueError(f"the threshold value of rule={rule!r} must be a number (not NaN; +-inf keeps or "
                                 "drops every example)")
            return
        raise ValueError(f"rule must be 'negative', ('bottom', fraction) or ('threshold', value), got {rule!r}")

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
        if not batches or step < self.start_step:
            return
        train = concat(batches) if len(batches) > 1 else batches[0]
        target = self._target_vectors(train)
        scores = dense_inner(train, target)  # [E]: <g_e, target>
        if self.normalize:
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
        if kept_total < self.min_keep:  # keep the best ones back (locally) rather than dropping everything
            order = torch.argsort(scores, descending=True)
            restore = order[: max(0, self.min_keep - kept_total)] if not ready else order[:1]
            drop[restore] = False
            warnings.warn(f"gradtrace selection: step {step} would drop every example; kept {len(restore)} "
                          "with the highest scores", stacklevel=2)
        weights = 1.0 / train.scale.to(torch.float64)  # each example's share of the loop's loss gradient
        self._subtract(train, weights * drop.to(torch.float64), weights, ready, world)
        ids = [train.ids[i] for i in drop.nonzero().flatten().tolist()]
        record = SelectionRecord(step, len(train), ids)
        if self.record_scores:
            record.scores = {ident: float(s) for ident, s in zip(train.ids, scores.tolist())}
        self.history.append(record)

    def _ddp_state(self) -> tuple[bool, int]:
        ready, world = _dist()
        if self.ddp is False:
            return False, 1
        return ready, world

    def _choose(self, scores: Tensor) -> Tensor:
        if self.rule == "negative":
            return scores < 0
        kind, value = self.rule
        if kind == "threshold":
            return scores < float(value)
        count = round(float(value) * scores.numel())
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
            if self.renormalize and total_share - dropped_share > 0:
                param.grad.mul_(total_share / (total_share - dropped_share))

    # -- targets -----------------------------------------------------------------------------------
    def _target_vectors(self, train: GradientBatch) -> dict[str, Tensor]:
        """The target gradient as dense per-parameter tensors laid out like ``train``'s parameters."""
        if isinstance(self.target, str) and self.target == "batch":
            weights = torch.full((len(train),), 1.0 / len(train))
            return {name: weighted_sum(pg, weights) for name, pg in train.params.items()}
        if isinstance(self.target, str) and self.target == "validation":
            val = self._validation_batch()
            check_compatible(train, val, "selection target (validation gradients)")
            weights = torch.full((len(val),), 1.0 / len(val))
            return {name: weighted_sum(pg, weights) for name, pg in val.params.items()}
        return _fixed_target(self.target, train)

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

