"""Recording a training trajectory: every example's gradient at every optimizer step, with its step size.

Trajectory-aware methods (DVEmb, :mod:`gradtrace.fit.methods.dvemb`) need, for each optimizer step ``t``, the
per-example gradients of the batch ``B_t`` at ``theta_t`` and the step size each example got. A
:class:`TrajectoryWriter` is a capture callback that records exactly that from an unmodified loop::

    writer = TrajectoryWriter("runs/trajectory", optimizer)
    with gradtrace.capture(model, gradtrace.Loss(reduction="mean"),
                           options=gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=8)),
                           callbacks=[writer]) as cap:
        for batch in loader:
            cap.annotate(ids=batch.pop("id"))
            loss_fn(model(**batch)).backward()
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Each row is one example at one optimizer step, keyed ``f"{id}@{step}"`` (so the repeats of later epochs are all
kept), with per-row fields:

* ``example``: the example's id;
* ``step``: the optimizer step the gradient belongs to -- ``optimizer.step()`` calls are counted with a step
  post-hook, so the backward passes of gradient accumulation share one step;
* ``lr``: ``optimizer.param_groups[0]["lr"]`` when the backward pass ends (the rate that step will use);
* ``weight``: the example's effective SGD step size, ``lr / scale`` where ``scale`` is the factor the capture
  removed from the loop's loss (the batch size for a mean loss, times the accumulation steps when the loop
  divides by them and says so with ``capture(model, Loss(scale=1/accum), ...)``): the step is
  ``theta_{t+1} = theta_t - sum_rows weight * g``;
* ``backward``: the backward pass within the capture session.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..capture.callbacks import CaptureCallback
from ..capture.gradient_set import GradientSet
from ..capture.sink.rows import MemoryRows, RowBackend, RowSink, RowTransform, ShardRows
from ..common.checks import count
from ..grad.batch import GradientBatch
from ..options import StoreOptions, with_record
from ..options.base import option_object
from ..store import GradientSpec, GradientStore, ShardWriter, model_fingerprint
from ..store.writer import resolved_store_options

__all__ = ["FIELDS", "TrajectoryKeys", "TrajectoryRows", "TrajectoryWriter", "step_weights"]

FIELDS = ("example", "step", "lr", "weight", "backward")


class TrajectoryKeys:
    """Row keys of a trajectory store: ``f"{id}@{step}"``, and ``f"{id}@{step}#{n}"`` for the ``n``-th repeat of
    an id within one optimizer step (the same example twice in a step is two rows)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # occurrences of each id within the current step
        self._step: int | None = None

    def __call__(self, ids: list[str], step: int) -> list[str]:
        if self._step != step:
            self._seen, self._step = {}, step
        keys = []
        for ident in ids:
            count = self._seen.get(ident, 0)
            self._seen[ident] = count + 1
            keys.append(f"{ident}@{step}" if count == 0 else f"{ident}@{step}#{count}")
        return keys


def step_weights(scale: Tensor, lr: float) -> list[float]:
    """Each example's effective SGD step size ``lr / scale`` (0 where the capture's scale is 0)."""
    scale = scale.detach().to("cpu", torch.float64)
    return torch.where(scale > 0, lr / scale.clamp(min=1e-300), torch.zeros_like(scale)).tolist()


class TrajectoryRows(RowTransform):
    """Rows of a trajectory: keyed ``f"{id}@{step}"`` by optimizer step, with the fields of :data:`FIELDS`."""

    def __init__(self, writer: TrajectoryWriter) -> None:
        self.writer = writer
        self._keys = TrajectoryKeys()

    def spec(self, layout: GradientSpec) -> GradientSpec:
        return dataclasses.replace(layout, convention={**layout.convention, "features": "trajectory"})

    def keys(self, batch: GradientBatch) -> list[str]:
        return self._keys(batch.ids, self.writer.step)

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        lr, count = self.writer.learning_rate(), len(batch)
        return {"example": list(batch.ids), "step": [self.writer.step] * count, "lr": [lr] * count,
                "weight": step_weights(batch.scale, lr), "backward": [batch.step] * count}


class TrajectoryWriter(CaptureCallback):
    """Capture callback recording each example's (projected) gradient at every optimizer step.

    Args:
        path: store directory; None keeps the rows in memory (:meth:`result` returns a
            :class:`~gradtrace.GradientSet`).
        optimizer: the loop's optimizer: its ``step()`` calls are counted and its learning rate read.
        store_options: how the store is written (:class:`gradtrace.StoreOptions`; shards of 4096 rows by
            default). A store records it and the capture's :class:`gradtrace.CaptureOptions`
            (``config["gradtrace"]["options"]`` of its manifest: ``store`` and ``capture``), as
            :func:`gradtrace.collect` does.
        start_step: the index of the first optimizer step recorded (a run resumed from a checkpoint).

    The optimizer hook is installed when the capture starts and removed when it ends. Pass your own ids with
    ``cap.annotate(ids=...)``: the default content-hash ids count repeats of the same content as new examples
    (``id#1``) unless ``cap.reset_ids()`` is called at every epoch.
    """

    def __init__(self, path: str | Path | None, optimizer: torch.optim.Optimizer, *,
                 store_options: StoreOptions | None = None, start_step: int = 0) -> None:
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        store_options = option_object(store_options, StoreOptions, "store_options")
        if path is None and (store_options.resume or store_options.overwrite):
            raise ValueError("resume/overwrite apply to a store: pass a path")
        count(start_step, "start_step", minimum=0)
        self.path = Path(path) if path is not None else None
        self.optimizer = optimizer
        shard_rows = store_options.shard_rows or (4096 if store_options.shard_bytes is None else None)
        self.store_options = replace(resolved_store_options(path, store_options), shard_rows=shard_rows)
        self.dtype = self.store_options.dtype
        self.capture_options: Any = None  # the capture's resolved CaptureOptions, from on_capture_start
        self.config = {"trajectory": {"optimizer": type(optimizer).__name__, "start_step": start_step},
                       **(store_options.config or {})}
        self.step = int(start_step)  # the optimizer step the next backward pass belongs to
        self.model = None
        self._handle: Any = None
        self._warned = False
        backend: RowBackend = ShardRows(self._open_store) if self.path is not None else MemoryRows()
        self.sink = RowSink(backend, transform=TrajectoryRows(self), dtype=self.dtype,
                            what="the trajectory started with",
                            fingerprint=lambda: model_fingerprint(self.model) if self.model is not None else {})

    def _open_store(self, spec: GradientSpec) -> ShardWriter:
        assert self.path is not None
        config = with_record(self.config, capture=self.capture_options, store=self.store_options)
        return ShardWriter(self.path, spec, replace(self.store_options, config=config))

    @property
    def spec(self) -> GradientSpec | None:
        """The spec of the recorded rows (None before the first backward pass)."""
        return self.sink.spec

    @property
    def writer(self) -> ShardWriter | None:
        """The store's writer while a capture session writes it (None otherwise)."""
        backend = self.sink.backend
        return backend.writer if isinstance(backend, ShardRows) and self.sink.opened else None

    # -- capture callback ----------------------------------------------------------------------
    def on_capture_start(self, capture: Any) -> None:
        self.model = capture.model
        self.capture_options = getattr(capture, "options", None)
        if self._handle is None:
            self._handle = self.optimizer.register_step_post_hook(self._on_step)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1

    def learning_rate(self) -> float:
        """The learning rate of the optimizer's first parameter group, now."""
        groups = self.optimizer.param_groups
        if not self._warned and len({float(g["lr"]) for g in groups}) > 1:
            self._warned = True
            warnings.warn("gradtrace: the optimizer's parameter groups have different learning rates; the trajectory "
                          "records group 0's (DVEmb then mis-weights the other groups' parameters)", stacklevel=3)
        return float(groups[0]["lr"])

    def on_batch(self, batch: GradientBatch, capture: Any = None) -> None:
        self.sink.add(batch)

    def on_capture_end(self, capture: Any, error: BaseException | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.writer is not None:
            self.sink.close(complete=error is None)
            self.store_options = replace(self.store_options, resume=True, overwrite=False)  # a later session appends

    # -- results -------------------------------------------------------------------------------
    def result(self) -> GradientStore | GradientSet:
        """The recorded trajectory: the store (opened) or, in memory, a :class:`~gradtrace.GradientSet`."""
        if self.spec is None:
            raise ValueError("nothing was recorded: no backward pass ran inside the capture")
        if self.path is not None:
            if self.writer is not None:
                raise RuntimeError("the capture is still running: read the trajectory after it ends")
            return GradientStore.open(self.path)
        rows = self.sink.backend
        assert isinstance(rows, MemoryRows)
        return GradientSet(rows.vectors(), list(rows.ids), self.spec,
                           fields={k: list(v) for k, v in rows.kept_fields().items()})
