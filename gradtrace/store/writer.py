"""Writing gradient stores: a background shard writer and the capture callback around it.

The backward pass never waits on disk: :meth:`ShardWriter.put` hands rows to a bounded queue and a
background thread quantizes each batch and appends it to the open shard's temporary files (checksummed as
they grow); a full shard is committed atomically (rename, then its record). Memory is bounded by the queue
(``queue_size`` batches), whatever the shard size or the number of rows: shards are sized in bytes
(:data:`DEFAULT_SHARD_BYTES`), so a hard kill loses at most one shard's rows. An error in the
thread (a full disk, a vanished directory) is raised at the next ``put``/``close`` with the state of the
store: every shard committed before it stays readable, and a later run can resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from ..capture.callbacks import CaptureCallback
from ..grad.batch import GradientBatch
from ..grad.quantize import quantize
from .layout import (
    DTYPES,
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    SHARD_FILE,
    StoreError,
    _fsync_dir,
    acquire_lock,
    atomic_write_json,
    checksum,
    create_exclusive,
    json_bytes,
    lock_is_stale,
    manifest_checksum,
    rank_file,
    read_lock,
    release_lock,
    shard_name,
)
from .reader import scan_shards
from .spec import GradientSpec, SpecMismatch, first_occurrences, model_fingerprint

__all__ = ["DEFAULT_MAX_SHARD_ROWS", "DEFAULT_SHARD_BYTES", "ShardWriter", "StoreWriteError", "StoreWriter",
           "batch_digests", "dist_rank", "row_bytes", "rows_per_shard"]

DEFAULT_SHARD_BYTES = 256 * 2**20
"""Default size of a shard's files (data + scales): what a hard kill can lose at most."""

DEFAULT_MAX_SHARD_ROWS = 65536
"""With the default shard size, rows per shard are capped too: a shard's ids and per-row fields are held in
memory until its record is written, so small rows must not make a shard of millions of ids."""

_QUANT_MODE = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}


class StoreWriteError(StoreError):
    """The background writer failed; committed shards are intact."""


def dist_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of the current torch.distributed process group, or ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def batch_digests(batch: GradientBatch) -> list[str | None] | None:
    """The content digest of each example of ``batch`` (``batch.meta["digest"]``, set by the capture from the
    example's unpadded inputs), or None when the batch carries none."""
    digests = batch.meta.get("digest")
    if not isinstance(digests, list) or len(digests) != len(batch.ids):
        return None
    return digests


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes one stored row takes on disk: ``dim`` values in ``dtype``, plus a float32 scale for int8."""
    return dim * DTYPES[dtype][1] + (4 if dtype == "int8" else 0)


def rows_per_shard(dim: int, dtype: str, shard_rows: int | None = None, shard_bytes: int | None = None) -> int:
    """Rows per shard: ``shard_rows`` when given, else as many rows as fit in ``shard_bytes`` (default
    :data:`DEFAULT_SHARD_BYTES`, then at most :data:`DEFAULT_MAX_SHARD_ROWS` rows). Raises ``ValueError`` for
    both given, a non-positive size, or ``shard_bytes`` smaller than one row."""
    if shard_rows is not None and shard_bytes is not None:
        raise ValueError("pass shard_rows or shard_bytes, not both")
    if shard_rows is not None:
        if shard_rows < 1:
            raise ValueError("shard_rows must be positive")
        return shard_rows
    one = row_bytes(dim, dtype)
    if shard_bytes is None:
        return max(1, min(DEFAULT_MAX_SHARD_ROWS, DEFAULT_SHARD_BYTES // max(1, one)))
    if shard_bytes < one:
        raise ValueError(f"shard_bytes={shard_bytes:,} is smaller than one row ({one:,} bytes: {dim:,} values in "
                         f"{dtype}); pass at least {one:,}")
    return shard_bytes // max(1, one)


class _OpenShard:
    """The shard being written: its temporary files, their running checksums and sizes, its ids and fields."""

    def __init__(self, shards: Path, name: str, seq: int, scaled: bool) -> None:
        self.name, self.seq, self.rows = name, seq, 0
        self.ids: list[str] = []
        self.fields: dict[str, list] = {}
        self.parts = ("data", "scale") if scaled else ("data",)
        self.tmp = {part: shards / f".tmp-{name}.{part}" for part in self.parts}
        self.final = {part: shards / f"{name}.{part}" for part in self.parts}
        self.files: dict[str, IO[bytes]] = {}  # raw (unbuffered) files
        try:
            for part in self.parts:
                # unbuffered: each batch goes to the file at once (one write), nothing is held back in memory
                self.files[part] = open(self.tmp[part], "wb", buffering=0)  # noqa: SIM115 - closed by finish/abandon
        except BaseException:
            self.abandon()
            raise
        self.hashes = {part: hashlib.blake2b(digest_size=16) for part in self.parts}
        self.sizes = dict.fromkeys(self.parts, 0)

    def append(self, part: str, values: Tensor) -> None:
        """Append ``values`` (a CPU tensor) to ``part``'s file, without copying it to ``bytes``."""
        view = memoryview(values.contiguous().numpy()).cast("B")
        done = 0
        while done < len(view):  # a raw write may be short
            done += self.files[part].write(view[done:])
        self.hashes[part].update(view)
        self.sizes[part] += len(view)

    def add_rows(self, ids: list[str], fields: dict[str, list]) -> None:
        """Record the ids and per-row fields of rows just appended (a field some rows lack: None for them)."""
        for key in self.fields.keys() - fields.keys():
            self.fields[key].extend([None] * len(ids))
        for key, values in fields.items():
            self.fields.setdefault(key, [None] * self.rows).extend(values)
        self.ids += ids
        self.rows += len(ids)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Fsync, close and rename the files to their final names; returns the record's ``files`` entry."""
        for part in self.parts:
            handle = self.files.pop(part)
            with handle:
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(self.tmp[part], self.final[part])
        _fsync_dir(next(iter(self.final.values())).parent)
        return {part: {"name": self.final[part].name, "bytes": self.sizes[part],
                       "blake2b": self.hashes[part].hexdigest()} for part in self.parts}

    def abandon(self) -> None:
        """Close and remove the temporary files (a failed writer leaves no partial shard behind)."""
        for handle in self.files.values():
            with contextlib.suppress(OSError):
                handle.close()
        self.files.clear()
        for path in self.tmp.values():
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _delete_store(root: Path, own_lock: Path) -> None:
    """Delete the store at ``root`` but the lock ``own_lock`` (held by the caller); refused while another
    live process holds a rank's lock."""
    for path in root.glob("rank-*.lock"):
        if path == own_lock:
            continue
        try:
            holder = read_lock(root, int(path.stem.split("-")[1]))
        except ValueError:
            continue
        if holder is None or lock_is_stale(holder):
            continue
        raise StoreError(f"cannot overwrite {root}: it is being written by pid {holder.get('pid')} on "
                         f"{holder.get('host')} ({path.name})")
    (root / MANIFEST).unlink(missing_ok=True)  # first: a half-deleted store is no store
    for path in root.iterdir():
        if path == own_lock:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


class ShardWriter:
    """Appends per-example vectors of one rank to a store, in shards of ``shard_bytes`` (or ``shard_rows``).

    Rows are written as they come: each batch is appended to the open shard's temporary files, and a shard
    is committed (renamed, then its record written) when it is full or the writer closes, so memory holds
    at most the queued batches.

    Rows whose id the store already holds (stored by an earlier run, by another rank before this writer
    opened, or put earlier by this writer) and rows with NaN/inf values are not written; they are counted
    (ids of non-finite rows listed) under ``skipped`` in this rank's status file. When rows come with
    content digests (``put(..., digests=)``, stored as the per-row field ``"digest"``), an id that comes
    back with another digest than the one stored is two different examples sharing an id:
    :class:`~gradtrace.store.IdCollision`. Without a digest on either side a repeated id is taken to be
    the same example (skipped and counted).

    Args:
        root: store directory (created if missing).
        spec: the layout of the vectors; an existing store must have the same one.
        rank, world_size: this process's shard namespace (``torch.distributed`` values by default).
        shard_rows: rows per shard (instead of ``shard_bytes``).
        shard_bytes: size of a shard's files (default :data:`DEFAULT_SHARD_BYTES`, 256 MiB): as many rows
            as fit; at least one row's size. A hard kill loses at most one shard.
        queue_size: batches that may wait for the writer thread before ``put`` blocks.
        resume: append to an existing store, skipping ids it already holds (see :attr:`stored_ids`).
        overwrite: delete an existing store first. In a multi-rank run only rank 0 deletes, and it refuses
            while another rank's writer is running: start rank 0's writer first or delete the directory.
        config: free-form configuration recorded in the manifest.
    """

    def __init__(self, root: str | Path, spec: GradientSpec, *, rank: int | None = None,
                 world_size: int | None = None, shard_rows: int | None = None, shard_bytes: int | None = None,
                 queue_size: int = 8, resume: bool = False, overwrite: bool = False,
                 config: dict[str, Any] | None = None) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"storage dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        shard_rows = rows_per_shard(spec.dim, spec.dtype, shard_rows, shard_bytes)
        if queue_size < 1:
            raise ValueError("queue_size must be positive")
        if resume and overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other; pass one of them")
        auto_rank, auto_world = dist_rank()
        self.rank = auto_rank if rank is None else rank
        self.world_size = auto_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.root = Path(root)
        self.spec = spec
        self.shard_rows = shard_rows
        self._check_target()
        self._lock = acquire_lock(self.root, self.rank)
        try:
            if overwrite:
                self._remove_old()
            self._prepare(resume, overwrite, config or {})
            self._cleanup_uncommitted()
            self.stored_ids: set[str] = set()
            self._digests: dict[str, str] = {}  # content digest of each stored id that has one
            self._committed: list[dict[str, Any]] = []  # this rank's shards, as its rank file lists them
            self._next_seq, self.rows_written = self._scan_existing()
            self._resumed_ids = frozenset(self.stored_ids)
            self.skipped: dict[str, Any] = {"nonfinite": [], "already_stored": 0, "duplicate": 0}
            self._load_previous_skips()
            self._write_status("writing")
        except BaseException:
            release_lock(self.root, self.rank)
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._closed = False
        self._open: _OpenShard | None = None  # the shard being appended to (writer thread only)
        self._thread = threading.Thread(target=self._run, name=f"gradtrace-store-r{self.rank}", daemon=True)
        self._thread.start()

    # -- setup -----------------------------------------------------------------------------------
    _STORE_ENTRIES = ("shards", MANIFEST)

    def _check_target(self) -> None:
        """Refuse to write into a directory that holds something other than a gradient store."""
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / MANIFEST).exists():
            return
        foreign = [p.name for p in self.root.iterdir()
                   if p.name not in self._STORE_ENTRIES and not p.name.startswith((".tmp-", "rank-"))]
        if foreign:
            raise StoreError(f"{self.root} is not empty and is not a gradient store (it holds {sorted(foreign)[:5]}); "
                             "choose a new or empty directory")

    def _read_manifest(self, corrupt_ok: bool = False) -> dict[str, Any] | None:
        """The existing manifest (None if there is none, or it is unreadable and ``corrupt_ok``)."""
        path = self.root / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as err:
            if corrupt_ok and (self.root / "shards").is_dir():
                return None
            raise StoreError(f"{path} is corrupted ({err}); pass overwrite=True to replace the store") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise StoreError(f"{self.root} is not a gradtrace store ({MANIFEST} has another format); "
                             "choose another directory")
        return manifest

    def _remove_old(self) -> None:
        """``overwrite``: rank 0 deletes the old store (none of whose writers may be running); another rank
        deletes only its own old rows."""
        self._read_manifest(corrupt_ok=True)  # refuses to delete a directory that is not a store
        if self.rank != 0:
            self._delete_rank_files(self.rank)
            return
        _delete_store(self.root, self._lock)

    def _delete_rank_files(self, rank: int) -> None:
        rank_file(self.root, rank).unlink(missing_ok=True)
        for path in (self.root / "shards").glob(f"{shard_name(rank, 0)[:6]}-*"):
            path.unlink(missing_ok=True)

    def _prepare(self, resume: bool, overwrite: bool, config: dict[str, Any]) -> None:
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        manifest = json.loads(json.dumps({
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "created": _now(), "spec": self.spec.to_dict(),
            "shard_rows": self.shard_rows, "world_size": self.world_size, "config": config}))
        manifest["checksum"] = manifest_checksum(manifest)
        self._manifest = manifest
        if create_exclusive(self.root / MANIFEST, json_bytes(manifest)):
            return  # the first rank to arrive creates it; the others check it
        existing = self._read_manifest()
        if existing is None:
            raise StoreError(f"{self.root}/{MANIFEST} vanished while opening the store (another run deleting it?)")
        if existing.get("schema_version") != SCHEMA_VERSION:
            older = " (an older gradtrace's store: readable, but not resumable)" if existing.get(
                "schema_version") == 1 else ""
            raise StoreError(f"{self.root} has schema version {existing.get('schema_version')}{older}, this "
                             f"gradtrace writes version {SCHEMA_VERSION}; write to a new directory or pass "
                             "overwrite=True")
        if existing.get("checksum") != manifest_checksum(existing):
            raise StoreError(f"{self.root}/{MANIFEST} was edited or is corrupted (its checksum does not match its "
                             "content); restore it, or pass overwrite=True to replace the store")
        self._manifest = existing
        try:
            other = GradientSpec.from_dict(existing["spec"])
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError(f"{self.root}/{MANIFEST} has no valid spec ({err!r})") from None
        try:
            other.check_compatible(self.spec, f"store {self.root}", same_weights=False)
        except SpecMismatch as err:
            raise SpecMismatch(f"{err}; {self._mismatch_hint(overwrite)}") from None
        if other.dtype != self.spec.dtype:
            raise SpecMismatch(f"store {self.root} stores {other.dtype}, this run writes {self.spec.dtype}; "
                               f"{self._mismatch_hint(overwrite)}")
        if other.model.get("weights") != self.spec.model.get("weights") and resume:
            warnings.warn(f"gradtrace: resuming {self.root} with different model weights than the run that started "
                          "it; rows from the two runs are not comparable unless that is intended", stacklevel=4)
        if not (resume or overwrite or self._is_fresh_rank_peer(existing)):
            raise StoreError(f"{self.root} already holds a store; pass resume=True to add to it or overwrite=True "
                             "to replace it")

    def _mismatch_hint(self, overwrite: bool) -> str:
        if overwrite:  # only a rank > 0 gets here: rank 0 has not replaced the old store yet
            return "with overwrite=True in a multi-rank run, rank 0's writer must start first"
        return "write to a new directory or pass overwrite=True"

    def _is_fresh_rank_peer(self, manifest: dict[str, Any]) -> bool:
        """A manifest just created by another rank of the same run (no shards of ours yet)."""
        return (self.world_size > 1 and manifest.get("world_size") == self.world_size
                and not rank_file(self.root, self.rank).exists())

    def _cleanup_uncommitted(self) -> None:
        """Remove this rank's temporary files and data files without a commit record (a killed writer's)."""
        prefix = shard_name(self.rank, 0)[:6]
        shards = self.root / "shards"
        for path in shards.glob(f".tmp-{prefix}-*"):
            path.unlink(missing_ok=True)
        for path in shards.glob(f"{prefix}-*"):
            match = SHARD_FILE.fullmatch(path.name)  # only this rank's data files: never a file of the user's
            if match and match[3] != "json" and not path.with_suffix(".json").exists():
                path.unlink(missing_ok=True)

    def _scan_existing(self) -> tuple[int, int]:
        """Read the ids (and digests) every rank committed, checked as a reader checks them (but for data
        checksums), and this rank's shards (a record committed after the rank file's last update is adopted:
        the status written next lists it). Returns this rank's next shard number and rows."""
        shards, _, _ = scan_shards(self.root, self._manifest, verify=False,
                                   where=f" in {self.root} (remove that shard or pass overwrite=True)")
        for shard in shards:
            ids = shard.record["ids"]
            self.stored_ids.update(ids)
            digests = (shard.record.get("fields") or {}).get("digest")
            if digests is not None:
                self._digests.update((i, d) for i, d in zip(ids, digests) if d is not None)
            if shard.rank == self.rank:
                self._committed.append(shard.entry)
        return len(self._committed), sum(e["rows"] for e in self._committed)

    def _load_previous_skips(self) -> None:
        """Keep the non-finite ids an earlier run of this rank recorded (they are in no shard)."""
        try:
            previous = json.loads(rank_file(self.root, self.rank).read_text()).get("skipped") or {}
        except (OSError, ValueError, AttributeError):
            return
        earlier = previous.get("nonfinite") if isinstance(previous, dict) else None
        if isinstance(earlier, list):
            self.skipped["nonfinite"] = [i for i in earlier if i not in self.stored_ids]

    def _write_status(self, status: str, error: str | None = None) -> None:
        """Replace this rank's status file (atomically): status, counts, every committed shard, skips."""
        skipped = {k: (list(v) if isinstance(v, list) else v) for k, v in dict(self.skipped).items()}  # a snapshot
        atomic_write_json(rank_file(self.root, self.rank), {
            "rank": self.rank, "status": status, "rows": self.rows_written, "shards": self._next_seq,
            "updated": _now(), "skipped": skipped, "error": error, "committed": list(self._committed)})

    # -- writing ---------------------------------------------------------------------------------
    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None = None) -> list[int]:
        """Positions of the ``ids`` the store does not hold yet (first occurrence); the others are counted
        as skipped (``already_stored`` by an earlier run, or ``duplicate``) and from now on the kept ones are
        taken as stored.

        ``digests``: content digest of each row (None where unknown). An id seen before with another digest
        raises :class:`IdCollision` (nothing of this call is taken as stored then)."""
        keep, new, repeats = first_occurrences(
            ids, digests, lambda ident: (ident in self.stored_ids, self._digests.get(ident)),
            lambda ident: f"{'stored in' if ident in self._resumed_ids else 'written earlier in this run to'} "
                          f"{self.root}")
        for ident in repeats:
            self.skipped["already_stored" if ident in self._resumed_ids else "duplicate"] += 1
        self.stored_ids.update(new)
        self._digests.update((i, d) for i, d in new.items() if d is not None)
        return keep

    def note_nonfinite(self, ids: Sequence[str]) -> None:
        """Record ids whose gradients held NaN/inf (not stored; listed in the rank status file)."""
        listed = set(self.skipped["nonfinite"])
        self.skipped["nonfinite"] += [i for i in ids if i not in listed and i not in self.stored_ids]

    def put(self, ids: Sequence[Any], vectors: Tensor, fields: dict[str, Any] | None = None, *,
            selected: bool = False, digests: Sequence[str | None] | None = None) -> None:
        """Queue rows for writing. ``vectors``: ``[n, dim]`` float; ``fields``: per-row lists (e.g. step).

        The rows are copied: the caller may reuse ``vectors``. Blocks only while the queue is full.
        ``selected``: the ids were already passed through :meth:`select_new` (they are new).
        ``digests``: content digest of each row (see :meth:`select_new`), stored as the field ``"digest"``.
        """
        self._raise_if_failed()
        if self._closed:
            raise StoreError("this store writer is closed")
        ids = [str(i) for i in ids]
        if vectors.dim() != 2 or vectors.shape[1] != self.spec.dim or vectors.shape[0] != len(ids):
            raise ValueError(f"expected [{len(ids)}, {self.spec.dim}] vectors, got {tuple(vectors.shape)}")
        fields = {k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in (fields or {}).items()}
        if digests is not None:
            fields["digest"] = [None if d is None else str(d) for d in digests]
        for key, values in fields.items():
            if len(values) != len(ids):
                raise ValueError(f"field {key!r} has {len(values)} values for {len(ids)} rows")
        try:
            json.dumps(fields)
        except (TypeError, ValueError) as err:
            raise ValueError(f"per-row fields must be JSON values: {err}") from None
        vectors = vectors.detach()
        finite = torch.isfinite(vectors).all(dim=1).cpu() if vectors.numel() else torch.ones(len(ids), dtype=torch.bool)
        if not bool(finite.all()):
            bad = [ids[i] for i in (~finite).nonzero().flatten().tolist()]
            warnings.warn(f"gradtrace: {len(bad)} row(s) with NaN/inf values are not stored: {bad[:5]}", stacklevel=2)
            if selected:
                self.stored_ids.difference_update(bad)
                for ident in bad:
                    self._digests.pop(ident, None)
            self.note_nonfinite(bad)
        positions = finite.nonzero().flatten().tolist()  # one pass, not a tensor read per row
        row_digests = fields.get("digest")
        keep = positions if selected else [positions[k] for k in self.select_new(
            [ids[p] for p in positions], None if row_digests is None else [row_digests[p] for p in positions])]
        if not keep:
            return
        if len(keep) == len(ids):
            rows = vectors.to("cpu", torch.float32, copy=True)
        else:
            rows = vectors[torch.tensor(keep, device=vectors.device)].to("cpu", torch.float32)
            ids = [ids[p] for p in keep]
            fields = {k: [v[p] for p in keep] for k, v in fields.items()}
        self._queue.put((ids, rows, fields))
        if self._error is not None:  # the writer died while this put waited; the rows were not written
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreWriteError(
                f"writing {self.root} failed: {self._error!r}. {self.rows_written} rows of rank {self.rank} are "
                f"committed ({self._next_seq} shards) and readable with GradientStore.open(..., "
                "allow_incomplete=True); rows queued after them are lost. Fix the cause and resume with resume=True"
            ) from self._error

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    if self._open is not None:
                        self._commit()
                    return
                self._append(*item)
        except BaseException as err:  # surfaced to the caller by put()/close()
            self._error = err
            if self._open is not None:
                self._open.abandon()
                self._open = None
            while True:  # drain so that a blocked put() returns and sees the error
                try:
                    if self._queue.get_nowait() is None:
                        break
                except queue.Empty:
                    break

    def _append(self, ids: list[str], rows: Tensor, fields: dict[str, list]) -> None:
        """Quantize one batch's ``rows`` ``[n, dim]`` float32 and append them to the open shard(s), committing
        each shard that fills up."""
        done = 0
        while done < len(ids):
            if self._open is None:
                self._open = _OpenShard(self.root / "shards", shard_name(self.rank, self._next_seq), self._next_seq,
                                        scaled=self.spec.dtype == "int8")
            shard = self._open
            take = min(len(ids) - done, self.shard_rows - shard.rows)
            part = slice(done, done + take)
            q = quantize(rows[part], _QUANT_MODE[self.spec.dtype])
            shard.append("data", q.data.view(torch.int16) if q.data.dtype == torch.bfloat16 else q.data)
            if q.scale is not None:
                shard.append("scale", q.scale.to(torch.float32))
            shard.add_rows(ids[part], {k: v[part] for k, v in fields.items()})
            done += take
            if shard.rows == self.shard_rows:
                self._commit()

    def _commit(self) -> None:
        """Commit the open shard: files renamed to their names, then its record (the commit point), then the
        rank file listing it (a crash before that: the record is adopted by the next writer)."""
        shard, self._open = self._open, None
        assert shard is not None
        try:
            files = shard.finish()
        except BaseException:
            shard.abandon()
            raise
        record = {"name": shard.name, "rank": self.rank, "seq": shard.seq, "rows": shard.rows, "dim": self.spec.dim,
                  "dtype": self.spec.dtype, "files": files, "ids": shard.ids, "fields": shard.fields,
                  "written": _now()}
        atomic_write_json(self.root / "shards" / f"{shard.name}.json", record)  # the commit point
        self._committed.append({"name": shard.name, "rows": shard.rows, "record": checksum(json_bytes(record))})
        self._next_seq += 1
        self.rows_written += shard.rows
        self._write_status("writing")

    def close(self, complete: bool = True) -> None:
        """Write what is buffered, wait for the thread, and mark this rank complete (or interrupted).

        Raises :class:`StoreWriteError` when the background writer failed.
        """
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._queue.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                # the disk may still be full: the status then stays "writing", which reads as incomplete too
                with contextlib.suppress(OSError):
                    self._write_status("failed", repr(self._error))
                self._raise_if_failed()
            status = "complete" if complete else "interrupted"
            try:
                self._write_status(status)
            except OSError as err:
                raise StoreWriteError(
                    f"could not mark rank {self.rank} of {self.root} {status} ({err}): its {self.rows_written} rows "
                    f"({self._next_seq} shards) are committed and readable with GradientStore.open(..., "
                    "allow_incomplete=True); free space and resume with resume=True to complete it") from err
        finally:
            release_lock(self.root, self.rank)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc is None)


class StoreWriter(CaptureCallback):
    """Capture callback writing every captured example's gradient vector to a store.

    ``capture(model, projection=LoGra(...), callbacks=[StoreWriter("runs/train")])``: each backward
    pass's examples are flattened (projected ones are small), examples flagged NaN/inf are skipped and
    recorded, ids already in the store are skipped (``resume=True``; also the repeats of later epochs),
    and the rest queued for the background writer. Per-row fields ``step`` (backward pass) and anything
    ``fields(batch)`` returns are stored with each row. The spec (and the model fingerprint) is taken at
    the first backward pass.

    Args:
        path: store directory.
        dtype: storage format, ``"float32"``, ``"bfloat16"`` or ``"int8"`` (per-row scale).
        shard_rows, shard_bytes, queue_size, resume, overwrite, rank, world_size: see :class:`ShardWriter`.
        fields: optional ``fn(batch) -> {name: per-row list}`` of extra per-row metadata.
        config: recorded in the manifest.
    """

    def __init__(self, path: str | Path, *, dtype: str = "float32", shard_rows: int | None = None,
                 shard_bytes: int | None = None, queue_size: int = 8, resume: bool = False,
                 overwrite: bool = False, rank: int | None = None,
                 world_size: int | None = None, fields=None, config: dict[str, Any] | None = None) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"storage dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.path = Path(path)
        self.dtype = dtype
        if shard_rows is not None and shard_bytes is not None:
            raise ValueError("pass shard_rows or shard_bytes, not both")
        self.options = dict(shard_rows=shard_rows, shard_bytes=shard_bytes, queue_size=queue_size, resume=resume,
                            overwrite=overwrite, rank=rank, world_size=world_size, config=config)
        self.fields = fields
        self.writer: ShardWriter | None = None
        self.model = None
        self._together = False  # several ranks write this store (set when the capture starts)

    def on_capture_start(self, capture) -> None:
        self.model = capture.model
        world = dist_rank()[1]
        self._together = world > 1 and self.options["world_size"] in (None, world)
        if self._together:
            # the ranks write one store: same capture and store on all of them, or an error on every rank
            from ..distributed.agree import agreed, check_store_writers

            check_store_writers(self, capture)
            if self.options["overwrite"]:
                # rank 0 replaces the old store now, before any rank's writer opens (and holds its lock)
                with agreed(f"replacing the store {self.path}"):
                    if dist_rank()[0] == 0 and (self.path / MANIFEST).exists():
                        try:
                            old = json.loads((self.path / MANIFEST).read_text())
                        except ValueError:
                            old = {"format": FORMAT}  # a corrupted manifest: replaced, as by ShardWriter
                        if not isinstance(old, dict) or old.get("format") != FORMAT:
                            raise StoreError(f"{self.path} is not a gradtrace store; choose another directory")
                        lock = acquire_lock(self.path, 0)
                        try:
                            _delete_store(self.path, lock)
                        finally:
                            release_lock(self.path, 0)
                self.options = {**self.options, "overwrite": False}

    def spec_for(self, batch: GradientBatch) -> GradientSpec:
        return GradientSpec(params=list(batch.dims.items()), projection=batch.projection,
                            convention=batch.convention.to_dict(),
                            model=model_fingerprint(self.model) if self.model is not None else {}, dtype=self.dtype)

    def open(self, spec: GradientSpec) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self.path, spec, **self.options)
        return self.writer

    def on_batch(self, batch: GradientBatch, capture=None) -> None:
        if self.writer is None:
            self.open(self.spec_for(batch))
        writer = self.writer
        spec = writer.spec
        if list(batch.dims.items()) != spec.params or batch.projection != spec.projection:
            raise SpecMismatch(f"gradtrace: backward pass {batch.step} captured other parameters or another "
                               f"projection than the store {self.path} was opened with")
        candidates = list(range(len(batch)))
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            bad = set(batch.nonfinite.nonzero().flatten().tolist())
            writer.note_nonfinite([batch.ids[i] for i in candidates if i in bad])
            candidates = [i for i in candidates if i not in bad]
        digests = batch_digests(batch)
        keep = [candidates[k] for k in writer.select_new(
            [batch.ids[i] for i in candidates], None if digests is None else [digests[i] for i in candidates])]
        if not keep:
            return
        sub = batch if len(keep) == len(batch) else batch.select(keep)
        fields = {"step": [batch.step] * len(keep)}
        if self.fields is not None:
            extra = self.fields(sub)
            fields.update({k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in extra.items()})
        writer.put(sub.ids, sub.flat(), fields, selected=True,
                   digests=None if digests is None else [digests[i] for i in keep])

    def on_capture_end(self, capture, error: BaseException | None) -> None:
        if self.writer is not None:
            self.writer.close(complete=error is None)
        if error is None and self._together:
            torch.distributed.barrier()  # every rank's part is committed: the store opens complete on every rank
