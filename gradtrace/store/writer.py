"""Writing gradient stores: a background shard writer and the capture callback around it.

The backward pass never waits on disk: :meth:`ShardWriter.put` hands rows to a bounded queue and a
background thread quantizes them and writes full shards atomically. The queue is bounded, so a disk that
is slower than training eventually applies back-pressure instead of exhausting memory. An error in the
thread (a full disk, a vanished directory) is raised at the next ``put``/``close`` with the state of the
store: every shard committed before it stays readable, and a later run can resume.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..grad.batch import GradBatch
from ..grad.quantize import quantize
from .layout import (
    DTYPES,
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    StoreError,
    acquire_lock,
    atomic_write_bytes,
    atomic_write_json,
    checksum,
    rank_file,
    release_lock,
    shard_name,
)
from .spec import GradientSpec, SpecMismatch, model_fingerprint

__all__ = ["ShardWriter", "StoreWriteError", "StoreWriter", "dist_rank"]


class StoreWriteError(StoreError):
    """The background writer failed; committed shards are intact."""


def dist_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of the current torch.distributed process group, or ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ShardWriter:
    """Appends per-example vectors of one rank to a store, in shards of ``shard_rows`` rows.

    Args:
        root: store directory (created if missing).
        spec: the layout of the vectors; an existing store must have the same one.
        rank, world_size: this process's shard namespace (``torch.distributed`` values by default).
        shard_rows: rows per shard file.
        queue_size: batches that may wait for the writer thread before ``put`` blocks.
        resume: append to an existing store, skipping ids it already holds (see :attr:`stored_ids`).
        overwrite: delete an existing store first.
        config: free-form configuration recorded in the manifest.
    """

    def __init__(self, root: str | Path, spec: GradientSpec, *, rank: int | None = None,
                 world_size: int | None = None, shard_rows: int = 4096, queue_size: int = 8,
                 resume: bool = False, overwrite: bool = False, config: dict[str, Any] | None = None) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"storage dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        if shard_rows < 1:
            raise ValueError("shard_rows must be positive")
        auto_rank, auto_world = dist_rank()
        self.rank = auto_rank if rank is None else rank
        self.world_size = auto_world if world_size is None else world_size
        self.root = Path(root)
        self.spec = spec
        self.shard_rows = shard_rows
        self._prepare(resume, overwrite, config or {})
        self._lock = acquire_lock(self.root, self.rank)
        self._cleanup_temporaries()
        self.stored_ids, self._next_seq, self.rows_written = self._scan_existing()
        self.skipped: dict[str, list[str]] = {"nonfinite": [], "duplicate": []}
        self._write_status("writing")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._closed = False
        self._buffer: list[tuple[list[str], Tensor, dict[str, list]]] = []
        self._buffered = 0
        self._thread = threading.Thread(target=self._run, name=f"gradtrace-store-r{self.rank}", daemon=True)
        self._thread.start()

    # -- setup -----------------------------------------------------------------------------------
    def _prepare(self, resume: bool, overwrite: bool, config: dict[str, Any]) -> None:
        manifest_path = self.root / MANIFEST
        if manifest_path.exists() and overwrite and self.rank == 0:
            shutil.rmtree(self.root)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": _now(),
                    "spec": self.spec.to_dict(), "shard_rows": self.shard_rows, "world_size": self.world_size,
                    "config": config}
        if not manifest_path.exists():
            try:  # the first rank to arrive creates it; the others check it
                import os

                fd = os.open(manifest_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                with os.fdopen(fd, "w") as f:
                    json.dump(manifest, f, indent=1)
                return
            except FileExistsError:
                pass
        existing = json.loads(manifest_path.read_text())
        if existing.get("format") != FORMAT:
            raise StoreError(f"{self.root} is not a gradtrace store")
        other = GradientSpec.from_dict(existing["spec"])
        try:
            other.check_compatible(self.spec, f"store {self.root}", same_weights=False)
        except SpecMismatch as err:
            raise SpecMismatch(f"{err}; write to a new directory or pass overwrite=True") from None
        if other.dtype != self.spec.dtype:
            raise SpecMismatch(f"store {self.root} stores {other.dtype}, this run writes {self.spec.dtype}")
        if other.model.get("weights") != self.spec.model.get("weights") and resume:
            warnings.warn(f"gradtrace: resuming {self.root} with different model weights than the run that started "
                          "it; rows from the two runs are not comparable unless that is intended", stacklevel=3)
        if not resume and not self._is_fresh_rank_peer(existing):
            raise StoreError(f"{self.root} already holds a store; pass resume=True to add to it or overwrite=True "
                             "to replace it")

    def _is_fresh_rank_peer(self, manifest: dict[str, Any]) -> bool:
        """A manifest just created by another rank of the same run (no shards of ours yet)."""
        return (self.world_size > 1 and manifest.get("world_size") == self.world_size
                and not rank_file(self.root, self.rank).exists())

    def _cleanup_temporaries(self) -> None:
        prefix = f".tmp-{shard_name(self.rank, 0)[:6]}"
        for path in (self.root / "shards").glob(".tmp-*"):
            if path.name.startswith(prefix):
                path.unlink(missing_ok=True)

    def _scan_existing(self) -> tuple[set[str], int, int]:
        ids: set[str] = set()
        next_seq, rows = 0, 0
        for record in sorted((self.root / "shards").glob("r*.json")):
            data = json.loads(record.read_text())
            ids.update(data["ids"])
            if data["rank"] == self.rank:
                next_seq = max(next_seq, data["seq"] + 1)
                rows += data["rows"]
        return ids, next_seq, rows

    def _write_status(self, status: str, error: str | None = None) -> None:
        atomic_write_json(rank_file(self.root, self.rank), {
            "rank": self.rank, "status": status, "rows": self.rows_written, "shards": self._next_seq,
            "updated": _now(), "skipped": self.skipped, "error": error})

    # -- writing ---------------------------------------------------------------------------------
    def put(self, ids: list[str], vectors: Tensor, fields: dict[str, list] | None = None) -> None:
        """Queue rows for writing. ``vectors``: ``[n, dim]`` float; ``fields``: per-row lists (e.g. step)."""
        self._raise_if_failed()
        if self._closed:
            raise StoreError("this store writer is closed")
        if vectors.dim() != 2 or vectors.shape[1] != self.spec.dim or vectors.shape[0] != len(ids):
            raise ValueError(f"expected [{len(ids)}, {self.spec.dim}] vectors, got {tuple(vectors.shape)}")
        fields = {k: list(v) for k, v in (fields or {}).items()}
        for key, values in fields.items():
            if len(values) != len(ids):
                raise ValueError(f"field {key!r} has {len(values)} values for {len(ids)} rows")
        self.stored_ids.update(ids)
        self._queue.put((list(ids), vectors.detach().to("cpu", torch.float32), fields))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreWriteError(
                f"writing {self.root} failed: {self._error!r}. The store is readable up to its last committed "
                f"shard ({self.rows_written} rows of rank {self.rank}); fix the cause and resume with resume=True"
            ) from self._error

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    self._flush(final=True)
                    return
                self._buffer.append(item)
                self._buffered += len(item[0])
                self._flush(final=False)
        except BaseException as err:  # surfaced to the caller by put()/close()
            self._error = err
            while True:  # drain so that a blocked put() returns and sees the error
                try:
                    if self._queue.get_nowait() is None:
                        break
                except queue.Empty:
                    break

    def _flush(self, final: bool) -> None:
        while self._buffered >= self.shard_rows or (final and self._buffered > 0):
            take = min(self.shard_rows, self._buffered)
            ids, vecs, fields = [], [], {}
            while len(ids) < take:
                b_ids, b_vecs, b_fields = self._buffer[0]
                need = take - len(ids)
                ids += b_ids[:need]
                vecs.append(b_vecs[:need])
                for k, v in b_fields.items():
                    fields.setdefault(k, []).extend(v[:need])
                if need >= len(b_ids):
                    self._buffer.pop(0)
                else:
                    self._buffer[0] = (b_ids[need:], b_vecs[need:], {k: v[need:] for k, v in b_fields.items()})
            self._buffered -= take
            self._write_shard(ids, torch.cat(vecs), fields)

    def _write_shard(self, ids: list[str], vectors: Tensor, fields: dict[str, list]) -> None:
        name = shard_name(self.rank, self._next_seq)
        shards = self.root / "shards"
        q = quantize(vectors, {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}[self.spec.dtype])
        data = q.data.view(torch.int16) if q.data.dtype == torch.bfloat16 else q.data
        raw = data.contiguous().numpy().tobytes()
        files = {"data": {"name": f"{name}.data", "bytes": len(raw), "blake2b": checksum(raw)}}
        atomic_write_bytes(shards / files["data"]["name"], raw)
        if q.scale is not None:
            scale_raw = q.scale.to(torch.float32).contiguous().numpy().tobytes()
            files["scale"] = {"name": f"{name}.scale", "bytes": len(scale_raw), "blake2b": checksum(scale_raw)}
            atomic_write_bytes(shards / files["scale"]["name"], scale_raw)
        record = {"name": name, "rank": self.rank, "seq": self._next_seq, "rows": len(ids), "dim": self.spec.dim,
                  "dtype": self.spec.dtype, "files": files, "ids": ids, "fields": fields, "written": _now()}
        atomic_write_json(shards / f"{name}.json", record)  # the commit point
        self._next_seq += 1
        self.rows_written += len(ids)

    def close(self, complete: bool = True) -> None:
        """Write what is buffered, wait for the thread, and mark this rank complete (or interrupted)."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._queue.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                self._write_status("failed", repr(self._error))
                self._raise_if_failed()
            self._write_status("complete" if complete else "interrupted")
        finally:
            release_lock(self.root, self.rank)


class StoreWriter:
    """Capture callback writing every captured example's gradient vector to a store.

    ``capture(model, projection=LoGra(...), callbacks=[StoreWriter("runs/train")])``: each backward
    pass's examples are flattened (projected ones are small), examples flagged NaN/inf are skipped and
    recorded, ids already in the store are skipped (``resume=True``), and the rest queued for the
    background writer. Per-row fields ``step`` (backward pass) and anything ``fields(batch)`` returns are
    stored with each row.

    Args:
        path: store directory.
        dtype: storage format, ``"float32"``, ``"bfloat16"`` or ``"int8"`` (per-row scale).
        shard_rows, queue_size, resume, overwrite, rank, world_size: see :class:`ShardWriter`.
        fields: optional ``fn(batch) -> {name: per-row list}`` of extra per-row metadata.
        config: recorded in the manifest.
    """

    def __init__(self, path: str | Path, *, dtype: str = "float32", shard_rows: int = 4096, queue_size: int = 8,
                 resume: bool = False, overwrite: bool = False, rank: int | None = None,
                 world_size: int | None = None, fields=None, config: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.options = dict(shard_rows=shard_rows, queue_size=queue_size, resume=resume, overwrite=overwrite,
                            rank=rank, world_size=world_size, config=config)
        self.fields = fields
        self.writer: ShardWriter | None = None
        self.model = None

    def on_capture_start(self, capture) -> None:
        self.model = capture.model

    def spec_for(self, batch: GradBatch) -> GradientSpec:
        return GradientSpec(params=list(batch.dims.items()), projection=batch.projection,
                            convention=batch.convention.to_dict(),
                            model=model_fingerprint(self.model) if self.model is not None else {}, dtype=self.dtype)

    def open(self, spec: GradientSpec) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self.path, spec, **self.options)
        return self.writer

    def on_batch(self, batch: GradBatch, capture=None) -> None:
        writer = self.open(self.spec_for(batch))
        keep = [i for i, ident in enumerate(batch.ids) if ident not in writer.stored_ids]
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            bad = set(batch.nonfinite.nonzero().flatten().tolist())
            writer.skipped["nonfinite"] += [batch.ids[i] for i in keep if i in bad]
            keep = [i for i in keep if i not in bad]
        if not keep:
            return
        sub = batch if len(keep) == len(batch) else batch.select(keep)
        fields = {"step": [batch.step] * len(keep)}
        if self.fields is not None:
            extra = self.fields(sub)
            fields.update({k: list(v) for k, v in extra.items()})
        writer.put(sub.ids, sub.flat(), fields)

    def on_capture_end(self, capture, error: BaseException | None) -> None:
        if self.writer is not None:
            self.writer.close(complete=error is None)
