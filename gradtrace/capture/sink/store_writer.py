"""``StoreWriter``: the capture callback that writes every captured example's gradient to a store.

It is a :class:`~gradtrace.capture.sink.rows.RowSink` with a shard back end, plus what a multi-rank run needs: the
ranks writing one store agree on what they capture and store (:func:`gradtrace.distributed.check_store_writers`),
rank 0 replaces an old store before any rank opens it, and every rank waits for the others' shards at the end.
The store itself (:mod:`gradtrace.store`) is pure I/O and knows nothing of captures or process groups.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ...grad.batch import GradientBatch
from ...options.base import option_object
from ...options.store import StoreOptions
from ...store.layout import MANIFEST
from ...store.spec import GradientSpec, fingerprint_like
from ...store.writer import ShardWriter, delete_store, per_row_lists, resolved_store_options
from ..callbacks import CaptureCallback
from ..coverage import record_coverage
from .rows import RowSink, RowTransform, ShardRows

__all__ = ["ExtraFields", "StoreWriter"]

FieldsFn = Callable[[GradientBatch], dict[str, Any]]


class ExtraFields(RowTransform):
    """The default rows, with the per-row fields ``extra(batch)`` returns added (they may replace ``step``)."""

    def __init__(self, extra: Callable[[], FieldsFn | None]) -> None:
        self.extra = extra  # returns the current fields function (None: no extra fields)

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        out = super().fields(batch)
        extra = self.extra()
        if extra is not None:
            out.update(per_row_lists(extra(batch)))
        return out


class StoreWriter(CaptureCallback):
    """Capture callback writing every captured example's gradient vector to a store.

    ``capture(model, options=CaptureOptions(projection=LoGra(...)), callbacks=[StoreWriter("runs/train")])``:
    each backward pass's examples are flattened (projected ones are small), examples flagged NaN/inf are skipped and
    recorded, ids already in the store are skipped (``StoreOptions(resume=True)``; also the repeats of later epochs),
    and the rest queued for the background writer. Per-row fields ``step`` (backward pass) and anything
    ``fields(batch)`` returns are stored with each row. The spec (and the model fingerprint) is taken at
    the first backward pass.

    Args:
        path: store directory.
        options: how the store is written (:class:`gradtrace.StoreOptions`; dtype float32 by default); see
            :class:`ShardWriter` (``resume`` refuses a store of other weights, projection or loss convention
            unless ``mixed_weights``, which admits other weights).
        mixed_weights, rank, world_size: see :class:`ShardWriter`.
        fields: optional ``fn(batch) -> {name: per-row list}`` of extra per-row metadata.
    """

    def __init__(self, path: str | Path, options: StoreOptions | None = None, *, mixed_weights: bool = False,
                 rank: int | None = None, world_size: int | None = None, fields: FieldsFn | None = None) -> None:
        options = option_object(options, StoreOptions, "options")
        if options.shard_rows is not None and options.shard_bytes is not None:
            raise ValueError("pass shard_rows or shard_bytes, not both")
        self.path = Path(path)
        self.store_options = resolved_store_options(path, options)
        self.dtype = self.store_options.dtype
        self.options = dict(mixed_weights=mixed_weights, rank=rank, world_size=world_size)
        self.fields = fields
        self.model = None
        self._coverage: Callable[[], Any] | None = None  # the capture's coverage(), recorded in the manifest
        self._together = False  # several ranks write this store (set when the capture starts)
        self._shards = ShardRows(self.open)
        self.sink = RowSink(self._shards, transform=ExtraFields(lambda: self.fields), dtype=self.dtype,
                            fingerprint=self._fingerprint,
                            what=f"the store {self.path} was opened with")

    @property
    def writer(self) -> ShardWriter | None:
        """The store's writer, opened by the first backward pass (None before)."""
        return self._shards.writer

    def on_capture_start(self, capture: Any) -> None:
        # imported here: gradtrace.distributed's package imports the sharded scoring, which imports this module
        from ...common.ranks import rank_and_world
        from ...distributed.agree import agreed, check_store_writers

        self.model = capture.model
        self._coverage = getattr(capture, "coverage", None)
        rank, world = rank_and_world()
        self._together = world > 1 and self.options["world_size"] in (None, world)
        if self._together:
            # the ranks write one store: same capture and store on all of them, or an error on every rank
            check_store_writers(self, capture)
            if self.store_options.overwrite:
                # rank 0 replaces the old store now, before any rank's writer opens (and holds its lock)
                with agreed(f"replacing the store {self.path}"):
                    if rank == 0:
                        delete_store(self.path)
                self.store_options = replace(self.store_options, overwrite=False)

    def _fingerprint(self) -> dict[str, str]:
        """The model's fingerprint, computed like the one of the store it resumes (one recorded without a scheme:
        the legacy digest, so that the same weights are recognised); a collective under FSDP2, on every rank."""
        if self.model is None:
            return {}
        stored = None
        if self.store_options.resume:
            try:
                stored = json.loads((self.path / MANIFEST).read_text())["spec"]["model"]
            except (OSError, ValueError, KeyError, TypeError):
                stored = None  # no store yet, or unreadable: the writer's own checks name the problem
        return fingerprint_like(self.model, stored if isinstance(stored, dict) else None)

    def spec_for(self, batch: GradientBatch) -> GradientSpec:
        """The spec of the store rows of ``batch`` (the model's fingerprint, this writer's dtype)."""
        return GradientSpec.from_batch(batch, model=self.sink.fingerprint(), dtype=self.dtype)

    def open(self, spec: GradientSpec) -> ShardWriter:
        """Open (once) the store's writer for rows of ``spec``."""
        if self._shards.writer is None:
            options = self.store_options
            if self._coverage is not None:  # the share of trainable parameters captured, as of the first rows
                options = replace(options, config=record_coverage(options.config, self._coverage()))
            self._shards.writer = ShardWriter(self.path, spec, options, **self.options)
        return self._shards.writer

    def on_batch(self, batch: GradientBatch, capture: Any = None) -> None:
        self.sink.add(batch)

    def on_capture_end(self, capture: Any, error: BaseException | None) -> None:
        self.sink.close(complete=error is None)
        if error is None and self._together:
            torch.distributed.barrier()  # every rank's part is committed: the store opens complete on every rank
