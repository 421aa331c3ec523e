"""Rows a training run writes to a gradient store: each example's gradient with its place in training.

:class:`TrainerRows` is the capture callback of the Trainer integration. It hands every captured example
to a :class:`~gradtrace.StoreWriter`, whose row sink it keys and gives per-row fields

* ``step``: optimizer steps completed when the gradient was taken -- its weights are those a checkpoint
  saved at that step holds (``checkpoint-{step}``);
* ``epoch``: the epoch (0-based); ``lr``: the learning rate of the update that consumes the gradient;
* ``backward``: the backward pass within the run;
* with ``trajectory=True`` also ``example`` (the id) and ``weight`` (``lr / scale``: the example's SGD step
  size given the Trainer's loss), and rows are keyed ``f"{id}@{step}"`` so every use of an example is kept
  (the layout of :class:`gradtrace.train.TrajectoryWriter`, which DVEmb reads).

It also checks the store before training starts (:func:`preflight`) and records the checkpoints the
Trainer saves in the store's manifest (:func:`record_checkpoints`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..capture.callbacks import CaptureCallback
from ..capture.sink import RowTransform, StoreWriter
from ..common.provenance import resolve_path
from ..grad.batch import GradientBatch
from ..store.artifact import atomic_write_json
from ..store.layout import MANIFEST, StoreError, lock_is_stale, read_lock
from ..train.trajectory import TrajectoryKeys, step_weights

__all__ = ["TrainerRows", "checkpoints", "preflight", "record_checkpoints", "segments", "shard_rows_for",
           "trained_weights"]

CONFIG_KEY = "trainer"
SHARD_BYTES = 256 * 2**20  # rows a writer buffers before writing a shard: at most this many bytes (float32)


def shard_rows_for(dim: int, limit: int = 4096) -> int:
    """Rows per shard so that a shard buffered in float32 stays under ``SHARD_BYTES`` (exact gradients of a large
    model are tens of MB per row; LoGra-projected ones a few KB, which keeps the usual 4096)."""
    return max(1, min(limit, SHARD_BYTES // max(1, 4 * dim)))


def preflight(path: Path, rank: int, world_size: int, resume: bool, overwrite: bool) -> None:
    """Refuse, before training starts, a store that the first backward pass could not write."""
    if path.exists() and not path.is_dir():
        raise StoreError(f"gradtrace: {path} exists and is not a directory")
    holder = read_lock(path, rank) if path.is_dir() else None
    if holder is not None and not lock_is_stale(holder):
        raise StoreError(f"gradtrace: {path} (rank {rank}) is being written by another run (pid {holder.get('pid')} "
                         f"on {holder.get('host')}); two runs cannot write the same store. Choose another store path; "
                         f"if that run is gone, delete {path}/rank-{rank:05d}.lock")
    if not path.is_dir():
        return
    if (path / MANIFEST).exists():
        if world_size == 1 and not (resume or overwrite):
            raise StoreError(f"gradtrace: {path} already holds a gradient store; pass "
                             "store_options=StoreOptions(resume=True) to add to it or StoreOptions(overwrite=True) to "
                             "replace it")
        return
    foreign = [p.name for p in path.iterdir() if p.name != "shards" and not p.name.startswith((".tmp-", "rank-"))]
    if foreign:
        raise StoreError(f"gradtrace: {path} is not empty and is not a gradient store (it holds {sorted(foreign)[:5]});"
                         " choose a new or empty directory")


def _merge(existing: list[dict], new: list[dict]) -> list[dict]:
    by_step = {int(c["step"]): c for c in existing}
    by_step.update({int(c["step"]): c for c in new})
    return [by_step[s] for s in sorted(by_step)]


def record_checkpoints(path: Path, entries: list[dict], settings: dict[str, Any] | None = None) -> None:
    """Merge checkpoint ``entries`` (and update ``settings``) into ``config.trainer`` of the store's manifest
    (an atomic rewrite; the manifest's other fields are unchanged)."""
    manifest_path = path / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    trainer = manifest.setdefault("config", {}).setdefault(CONFIG_KEY, {})
    trainer.update({k: v for k, v in (settings or {}).items() if k != "checkpoints"})
    trainer["checkpoints"] = _merge(trainer.get("checkpoints") or [], entries)
    atomic_write_json(manifest_path, manifest)


def checkpoints(store: Any) -> list[dict]:
    """The checkpoints a Trainer run saved while it wrote ``store`` (a path or an open store), by step.

    Each is ``{"step", "path", "epoch", "lr", "mean_lr", "updates", "weights"}`` (``path`` recorded relative to the
    store's folder, returned absolute; ``weights``: the model fingerprint): ``lr`` is the learning rate of the
    next update from the checkpoint's weights, ``mean_lr`` the mean rate of the ``updates`` optimizer steps
    since the previous checkpoint (LESS weights each checkpoint by it; TracIn by the rate of its interval).
    The store's ``config["trainer"]["optimizer_parameters"]`` names the optimizer's parameters in its order,
    which maps a checkpoint's ``optimizer.pt`` to the model (for ``less_features``: as each param group's
    ``"param_names"`` of its state dict); each entry
    carries it too (``"optimizer_parameters"``, when recorded), so that :func:`gradtrace.collect_checkpoints`
    records it in each checkpoint's store, where ``trackstar`` finds it.
    """
    root, trainer = _trainer_config(store)
    names = trainer.get("optimizer_parameters")
    named = {"optimizer_parameters": list(names)} if names else {}
    return [{**c, **named, "path": str(resolve_path(c["path"], root))} if c.get("path") else {**c, **named}
            for c in trainer.get("checkpoints") or []]


def segments(run: Any, chosen: Sequence[dict] | None = None) -> tuple[list[int], list[float]]:
    """``(steps, lr)`` of the training segments that end at each ``chosen`` checkpoint (default: every one), for
    :class:`gradtrace.Unrolled`: segment ``c`` is the optimizer steps after the previous chosen checkpoint (the first:
    from the start of training) up to checkpoint ``c``, and its learning rate the mean over those steps (from the
    ``mean_lr`` and ``updates`` the run recorded at each of its checkpoints in between).

    Args:
        run: the store a ``GradtraceCallback`` wrote (path or open store), or its :func:`checkpoints` list.
        chosen: entries of that list (e.g. ``checkpoints(store)[-6:]``), in training order.

    Raises:
        ValueError: a chosen entry not in the run, chosen entries out of order, or a segment whose recorded
            learning rates do not cover its steps (the run recorded rates for fewer updates than it stepped).
    """
    entries = sorted(run if isinstance(run, list) else checkpoints(run), key=lambda c: int(c["step"]))
    chosen = entries if chosen is None else list(chosen)
    known = {int(c["step"]) for c in entries}
    marks = [int(c["step"]) for c in chosen]
    missing = [m for m in marks if m not in known]
    if missing:
        raise ValueError(f"checkpoints at steps {missing[:3]} are not among the run's (steps {sorted(known)[:6]}...): "
                         "choose entries of checkpoints(store)")
    if any(b <= a for a, b in pairwise(marks)):
        raise ValueError(f"the chosen checkpoints must be in training order, got steps {marks}")
    steps, rates, start = [], [], 0
    for mark in marks:
        inside = [c for c in entries if start < int(c["step"]) <= mark]
        updates = sum(int(c.get("updates") or 0) for c in inside)
        if updates != mark - start or any(c.get("mean_lr") is None for c in inside if c.get("updates")):
            raise ValueError(f"the run recorded learning rates for {updates} updates between steps {start} and "
                             f"{mark}, which took {mark - start}: give Unrolled its steps= and lr= by hand")
        steps.append(mark - start)
        rates.append(sum(float(c["mean_lr"]) * int(c["updates"]) for c in inside if c.get("updates")) / updates)
        start = mark
    return steps, rates


def _trainer_config(store: Any) -> tuple[Path, dict[str, Any]]:
    """``(store folder, config["trainer"] of its manifest)`` of a store path or an open store."""
    if hasattr(store, "manifest"):
        return Path(store.root), (store.manifest.get("config") or {}).get(CONFIG_KEY) or {}
    manifest = json.loads((Path(store) / MANIFEST).read_text())
    return Path(store), (manifest.get("config") or {}).get(CONFIG_KEY) or {}


def trained_weights(store: Any) -> dict[str, str]:
    """``{weights fingerprint: what holds them}`` of the models a Trainer run's gradients belong to: each saved
    checkpoint whose step lies in the captured step range (``config["trainer"]["steps"]``; its rows were taken at
    those weights) and the final model of the run (which ``trainer.save_model()`` writes to the output dir). Empty
    for a store not written during training, or written before these were recorded."""
    _, trainer = _trainer_config(store)
    steps = trainer.get("steps") or {}
    first, last = steps.get("first"), steps.get("last")
    known = {}
    for c in trainer.get("checkpoints") or []:
        if c.get("weights") and first is not None and first <= int(c["step"]) <= last:
            known[c["weights"]] = f"checkpoint-{c['step']}"
    final = trainer.get("final") or {}
    if final.get("weights"):
        known[final["weights"]] = f"the final model (step {final.get('step')})"
    return known


class TrainerRows(RowTransform, CaptureCallback):
    """Capture callback writing each captured example, with its training position, to a store: the rows of the
    writer's sink are keyed and given fields by this transform.

    ``position`` is updated by the Trainer callback before each captured optimizer step:
    ``{"step", "epoch", "lr"}``. ``extra(ids)`` gives more per-row fields of a batch's examples (GRPO rollouts).
    """

    def __init__(self, writer: StoreWriter, *, trajectory: bool, auto_shard_rows: bool = False,
                 extra: Callable[[list], dict[str, list]] | None = None) -> None:
        self.writer = writer
        self.trajectory = trajectory
        self.extra = extra  # more per-row fields from the ids (GRPO: prompt, rollout, ...)
        self.auto_shard_rows = auto_shard_rows
        self.position: dict[str, Any] = {"step": 0, "epoch": 0, "lr": 0.0}
        self._keys = TrajectoryKeys()
        writer.sink.transform = self

    def keys(self, batch: GradientBatch) -> list[str]:
        return self._keys(batch.ids, self.position["step"]) if self.trajectory else list(batch.ids)

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        count = len(batch)
        pos = self.position
        fields = {"step": [pos["step"]] * count, "epoch": [pos["epoch"]] * count, "lr": [pos["lr"]] * count,
                  "backward": [batch.step] * count}
        if self.trajectory:
            fields["example"] = list(batch.ids)
            fields["weight"] = step_weights(batch.scale, pos["lr"])
        if self.extra is not None:
            fields.update(self.extra(list(batch.ids)))
        return fields

    def on_batch(self, batch: GradientBatch, capture: Any = None) -> None:
        if self.auto_shard_rows and self.writer.writer is None:  # the store opens with this batch
            self.writer.store_options = replace(self.writer.store_options,
                                                shard_rows=shard_rows_for(sum(batch.dims.values())))
        self.writer.on_batch(batch, capture)
