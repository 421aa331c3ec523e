"""Recording a plain training loop so that it can be replayed, and differentiated, exactly.

A :class:`RunRecorder` sits beside an unmodified loop::

    rec = RunRecorder("runs/r1", model, optimizer, grad_clip=1.0, accumulation=2)
    for step_batches in loader:                       # one optimizer step: `accumulation` micro-batches
        for mb in step_batches:
            (loss_fn(model, mb).mean() / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        rec.step([mb["ids"] for mb in step_batches])  # the example ids of each micro-batch, in order
    rec.finish(model)

It writes, under ``run_dir``: ``initial.safetensors`` (parameters and buffers when the recorder is made),
``steps.jsonl`` (per optimizer step: the ids of each micro-batch and the learning rate of every parameter
group, read by a pre-hook of ``optimizer.step()`` -- so any scheduler, e.g. transformers'
``get_cosine_schedule_with_warmup``, is captured without re-implementing it), ``final.safetensors`` (the weights
after the last step, for the replay check) and ``manifest.json`` (schema, optimizer kind and groups, reduction,
clipping, accumulation, dtypes, parameter names and shapes). With ``keep_states=N`` it also writes the optimizer
state before steps ``N, 2N, ...`` (:mod:`gradtrace.replay.states`): a truncated metagradient pass then replays from
the latest one instead of from the first step.

Randomness: the replay recomputes every forward pass, so a forward pass must be deterministic. The recorder
refuses a model with a dropout module of ``p > 0`` or a batch-norm layer with running statistics in training
mode (checked when it is made and at every step): put them in eval mode, or set ``p=0``. This is simpler and
safer than restoring RNG states, which would also have to match the order of every random call in the loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .spec import SCHEMA, Reduction, ReplayError, group_hyper, optimizer_spec
from .states import state_path, write_state
from .weights import model_tensors, write_tensors

__all__ = ["RunRecorder", "check_deterministic", "normalise_step_ids"]


def check_deterministic(model: torch.nn.Module) -> None:
    """Refuse a model whose training-mode forward pass is random or updates buffers.

    Raises:
        ReplayError: a dropout module with ``p > 0`` or a batch-norm with running statistics, in training mode.
    """
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ReplayError(f"module {name or type(module).__name__} is a dropout with p={module.p} in training "
                              "mode: the replay cannot reproduce it (set p=0 or call .eval() on it)")
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            raise ReplayError(f"module {name} is a batch-norm updating running statistics in training mode: the "
                              "replay does not follow buffer updates (call .eval() on it)")


def _check_id(ident: Any) -> Any:
    if isinstance(ident, bool) or not isinstance(ident, (int, str)):
        raise ReplayError(f"example id {ident!r} must be an int or a str")
    return ident


def normalise_step_ids(batch_ids: Sequence[Any], accumulation: int) -> list[list[Any]]:
    """The ids of one optimizer step as a list of micro-batches (a flat list is one micro-batch).

    Raises:
        ReplayError: ids that are not ints or strs, an empty micro-batch, or not ``accumulation`` micro-batches.
    """
    if isinstance(batch_ids, torch.Tensor):
        batch_ids = batch_ids.tolist()
    items = list(batch_ids)
    nested = bool(items) and isinstance(items[0], (list, tuple, torch.Tensor))
    micro = [list(m.tolist() if isinstance(m, torch.Tensor) else m) for m in items] if nested else [items]
    if len(micro) != accumulation:
        raise ReplayError(f"step ids hold {len(micro)} micro-batch(es), expected accumulation={accumulation}")
    if any(not m for m in micro):
        raise ReplayError("a micro-batch with no example ids")
    return [[_check_id(i) for i in m] for m in micro]


class RunRecorder:
    """Records what an exact replay needs, beside the user's own loop.

    Args:
        run_dir: directory written (created; must not already hold a manifest).
        model: the model trained (its current weights are the initial ones).
        optimizer: a fresh ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` over the model's parameters.
        scheduler: optional learning-rate scheduler (only its class name is recorded: the rates are read from
            the optimizer at every step).
        grad_clip: the ``max_norm`` the loop passes to ``torch.nn.utils.clip_grad_norm_`` (2-norm over all
            parameters) before each step, or None.
        accumulation: micro-batches per optimizer step.
        reduction: how the loop reduces per-example losses (:class:`Reduction`, the mean by default).
        keep_states: write the state before every ``keep_states``-th step (parameters and optimizer buffers, about
            3x the parameters' size for Adam, 2x for SGD with momentum, each time); None: none.

    Raises:
        ReplayError: an optimizer or model the replay cannot follow (see :func:`optimizer_spec`,
            :func:`check_deterministic`), or a run directory that already holds a run.
    """

    def __init__(self, run_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, grad_clip: float | None = None, accumulation: int = 1,
                 reduction: Reduction | None = None, keep_states: int | None = None) -> None:
        if accumulation < 1:
            raise ReplayError(f"accumulation={accumulation}: expected an int >= 1")
        if keep_states is not None and (isinstance(keep_states, bool) or not isinstance(keep_states, int)
                                        or keep_states < 1):
            raise ReplayError(f"keep_states={keep_states!r}: expected an int >= 1 (steps between kept states) or None")
        if grad_clip is not None and not grad_clip > 0:
            raise ReplayError(f"grad_clip={grad_clip}: expected a positive max norm or None")
        self.run_dir = Path(run_dir)
        if (self.run_dir / "manifest.json").exists():
            raise ReplayError(f"{self.run_dir} already holds a recorded run")
        check_deterministic(model)
        self.model, self.optimizer = model, optimizer
        names = {id(p): name for name, p in model.named_parameters()}
        self.spec = optimizer_spec(optimizer, names)
        self.grad_clip, self.accumulation = grad_clip, accumulation
        self.reduction = reduction or Reduction()
        self.scheduler = type(scheduler).__name__ if scheduler is not None else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_tensors(self.run_dir / "initial", model_tensors(model))
        self._steps_file = open(self.run_dir / "steps.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        self._pending: list[list[float]] = []
        self.steps = 0
        self.keep_states, self.kept_states = keep_states, []
        self._params = {name: p for name, p in model.named_parameters() if name in set(self.spec.param_names())}
        self._counts: dict[str, int] = {}  # updates per parameter so far (those with a gradient at a step)
        self._hook = optimizer.register_step_pre_hook(self._on_step)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if len(optimizer.param_groups) != len(self.spec.groups):
            raise ReplayError("the optimizer's parameter groups changed during the run")
        for group, spec in zip(optimizer.param_groups, self.spec.groups):
            if group_hyper(self.spec.kind, group) != spec.hyper:
                raise ReplayError(f"optimizer hyper-parameters changed during the run: {spec.hyper} -> "
                                  f"{group_hyper(self.spec.kind, group)} (only lr may change)")
        self._pending.append([float(g["lr"].item() if isinstance(g["lr"], torch.Tensor) else g["lr"])
                              for g in optimizer.param_groups])
        if self.keep_states is not None:
            for name, param in self._params.items():
                if param.grad is not None:
                    self._counts[name] = self._counts.get(name, 0) + 1

    def step(self, batch_ids: Sequence[Any]) -> None:
        """Record one optimizer step, after ``optimizer.step()``: the example ids of each micro-batch, in order.

        Args:
            batch_ids: a list of ``accumulation`` id lists (or one flat list when ``accumulation == 1``).

        Raises:
            ReplayError: no (or more than one) ``optimizer.step()`` since the last call, or bad ids.
        """
        if len(self._pending) != 1:
            raise ReplayError(f"RunRecorder.step: {len(self._pending)} optimizer.step() call(s) since the last "
                              "recorded step (expected exactly one; call rec.step after optimizer.step)")
        check_deterministic(self.model)
        micro = normalise_step_ids(batch_ids, self.accumulation)
        self._steps_file.write(json.dumps({"step": self.steps, "micro_batches": micro,
                                           "lr": self._pending.pop()}) + "\n")
        self._steps_file.flush()
        self.steps += 1
        if self.keep_states is not None and self.steps % self.keep_states == 0:
            write_state(self.run_dir, self.steps, self.spec, self._params, self.optimizer, self._counts)
            self.kept_states.append(self.steps)

    def finish(self, model: torch.nn.Module | None = None) -> Path:
        """Save the final weights and the manifest; remove the optimizer hook.

        Returns:
            the run directory.

        Raises:
            ReplayError: an ``optimizer.step()`` not followed by :meth:`step`, or a model with other parameters.
        """
        model = model if model is not None else self.model
        self._hook.remove()
        self._steps_file.close()
        if self._pending:
            raise ReplayError("an optimizer.step() was not followed by RunRecorder.step(ids)")
        params = dict(model.named_parameters())
        missing = sorted(set(self.spec.param_names()) - set(params))
        if missing:
            raise ReplayError(f"finish(model): the model lacks optimized parameters {missing[:5]}")
        write_tensors(self.run_dir / "final", model_tensors(model))
        if self.kept_states and self.kept_states[-1] == self.steps:  # the state after the last step: final's
            state_path(self.run_dir, self.steps).with_suffix(".safetensors").unlink(missing_ok=True)
            state_path(self.run_dir, self.steps).with_suffix(".pt").unlink(missing_ok=True)
            self.kept_states.pop()
        manifest = {
            "schema": SCHEMA, "steps": self.steps, "accumulation": self.accumulation,
            "grad_clip": self.grad_clip, "reduction": self.reduction.to_dict(), "optimizer": self.spec.to_dict(),
            "scheduler": self.scheduler, "model": type(model).__name__,
            "params": {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                       for name, p in params.items()},
            "buffers": [name for name, _ in model.named_buffers()],
            "states": {"every": self.keep_states, "steps": list(self.kept_states)},
        }
        tmp = self.run_dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        os.replace(tmp, self.run_dir / "manifest.json")
        return self.run_dir
