"""Writing gradient stores: :class:`ShardWriter` appends one rank's rows to a store, in shards.

The backward pass never waits on disk: :meth:`ShardWriter.put` hands rows to a bounded queue (CUDA rows encoded on
the device and copied to a pinned buffer without blocking: :mod:`~gradtrace.store.transfer`) and a
background thread (:mod:`~gradtrace.store.background`) quantizes each batch and appends it to the open shard's
temporary files, checksummed as they grow; a full shard is committed atomically (:mod:`~gradtrace.store.shards`).
Memory is bounded by the queue (``queue_size`` batches), whatever the shard size or the number of rows: shards
are sized in bytes (:data:`~gradtrace.store.shards.DEFAULT_SHARD_BYTES`), so a hard kill loses at most one
shard's rows. An error in the thread (a full disk, a vanished directory) is raised at the next
``put``/``close`` with the state of the store: every shard committed before it stays readable, and a later run
can resume. Which rows are kept (new ids, finite values) is the rule of :mod:`~gradtrace.store.ledger`.

The capture callback that writes a store, :class:`gradtrace.StoreWriter`, lives above the store, in
:mod:`gradtrace.capture.sink`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.provenance import environment
from ..options.base import option_object
from ..options.store import StoreOptions
from .artifact import atomic_write_json, create_exclusive, json_bytes
from .background import BackgroundWriter
from .layout import (
    DTYPES,
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    SHARD_FILE,
    StoreError,
    acquire_lock,
    lock_is_stale,
    manifest_checksum,
    rank_file,
    read_lock,
    release_lock,
    shard_name,
)
from .ledger import IdLedger
from .manifest import check_manifest
from .reader import scan_shards
from .shards import ShardSeries, rows_per_shard, utc_now
from .spec import GradientSpec, SpecMismatch
from .transfer import HostRows, PinnedPool, to_host

__all__ = ["ShardWriter", "StoreWriteError", "delete_store", "per_row_lists", "resolved_store_options"]


class StoreWriteError(StoreError):
    """The background writer failed; committed shards are intact."""


def per_row_lists(fields: dict[str, Any]) -> dict[str, list]:
    """Per-row fields as plain lists (tensors and arrays converted with ``tolist()``)."""
    return {k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in fields.items()}


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


def resolved_store_options(root: str | Path | None, options: StoreOptions) -> StoreOptions:
    """``options`` with its storage dtype decided: the one given; else, when resuming an existing store at ``root``,
    the dtype it holds (a resumed run need not repeat it); else float32 (also for rows kept in memory: ``root``
    None)."""
    if options.dtype is not None:
        return options
    manifest = Path(root) / MANIFEST if root is not None else None
    if options.resume and manifest is not None and manifest.is_file():
        try:
            dtype = json.loads(manifest.read_text())["spec"]["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            dtype = None  # unreadable: the writer's own checks name the problem
        if dtype in DTYPES:
            return replace(options, dtype=dtype)
    return replace(options, dtype="float32")


def delete_store(root: Path) -> None:
    """Delete the gradient store at ``root`` (nothing when there is none), holding rank 0's lock while it does;
    refuses a directory that is not a store and a store another live process is writing."""
    if not (root / MANIFEST).exists():
        return
    try:
        old = json.loads((root / MANIFEST).read_text())
    except ValueError:
        old = {"format": FORMAT}  # a corrupted manifest: replaced, as by ShardWriter
    check_manifest(root, old, "write", format_only=True)
    lock = acquire_lock(root, 0)
    try:
        _delete_store(root, lock)
    finally:
        release_lock(root, 0)


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
        options: how it is written (:class:`gradtrace.StoreOptions`): ``shard_rows`` or ``shard_bytes`` (default
            :data:`DEFAULT_SHARD_BYTES`, 256 MiB: as many rows as fit; at least one row's size; a hard kill loses
            at most one shard); ``queue_size`` batches may wait for the writer thread before ``put`` blocks;
            ``resume`` appends to an existing store, skipping ids it already holds (see :attr:`stored_ids`) --
            the store must have been written with the same model weights (fingerprint), projection and loss
            convention, another is refused (:class:`~gradtrace.store.SpecMismatch` naming what differs);
            ``overwrite`` deletes an existing store first (in a multi-rank run only rank 0 deletes, and it refuses
            while another rank's writer is running); ``config`` is recorded in the manifest. Its ``dtype``, when
            set, must be the spec's.
        rank, world_size: this process's shard namespace (``torch.distributed`` values by default).
        mixed_weights: let ``resume`` add rows taken at other weights of the same model (a store written
            during training, whose weights change every step; the Trainer callback passes it).
    """

    def __init__(self, root: str | Path, spec: GradientSpec, options: StoreOptions | None = None, *,
                 rank: int | None = None, world_size: int | None = None, mixed_weights: bool = False) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"storage dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        options = option_object(options, StoreOptions, "options")
        if options.dtype is not None and options.dtype != spec.dtype:
            raise ValueError(f"StoreOptions(dtype={options.dtype!r}) differs from the spec's dtype {spec.dtype!r}")
        shard_rows = rows_per_shard(spec.dim, spec.dtype, options.shard_rows, options.shard_bytes)
        resume, overwrite, config, queue_size = options.resume, options.overwrite, options.config, options.queue_size
        auto_rank, auto_world = _process_rank() if rank is None or world_size is None else (rank, world_size)
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
            self._prepare(resume, overwrite, config or {}, same_weights=resume and not mixed_weights)
            self._cleanup_uncommitted()
            self.ledger = IdLedger(str(self.root))
            self._shards = ShardSeries(self.root, self.rank, spec, shard_rows, self._scan_existing(),
                                       on_commit=lambda: self._write_status("writing"))
            self.ledger.mark_resumed()
            self._load_previous_skips()
            self._write_status("writing")
        except BaseException:
            release_lock(self.root, self.rank)
            raise
        self._closed = False
        self._pinned: PinnedPool | None = None  # host buffers of the device -> host copies (made by a CUDA put)
        self._background = BackgroundWriter(self._write_rows, self._shards.commit,
                                            self._shards.abandon, queue_size=queue_size,
                                            name=f"gradtrace-store-r{self.rank}")

    @property
    def stored_ids(self) -> set[str]:
        """Ids the store holds (committed by any rank before this writer opened, or put by it)."""
        return self.ledger.ids

    @property
    def skipped(self) -> dict[str, Any]:
        """Rows not written: ``{"nonfinite": [ids], "already_stored": count, "duplicate": count}``."""
        return self.ledger.skipped

    @property
    def rows_written(self) -> int:
        """Rows of this rank committed to shards."""
        return self._shards.rows

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

    def _read_manifest(self, replacing: bool = False) -> dict[str, Any] | None:
        """The existing manifest, checked for writing (:func:`check_manifest`); None if there is none.
        ``replacing`` (the store is to be overwritten): only its format is checked, and an unreadable one is None
        where ``shards/`` shows a store."""
        path = self.root / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as err:
            if replacing and (self.root / "shards").is_dir():
                return None
            raise StoreError(f"{path} is corrupted ({err}); pass overwrite=True to replace the store") from None
        return check_manifest(self.root, manifest, "write", format_only=replacing)

    def _remove_old(self) -> None:
        """``overwrite``: rank 0 deletes the old store (none of whose writers may be running); another rank
        deletes only its own old rows."""
        self._read_manifest(replacing=True)  # refuses to delete a directory that is not a store
        if self.rank != 0:
            self._delete_rank_files(self.rank)
            return
        _delete_store(self.root, self._lock)

    def _delete_rank_files(self, rank: int) -> None:
        rank_file(self.root, rank).unlink(missing_ok=True)
        for path in (self.root / "shards").glob(f"{shard_name(rank, 0)[:6]}-*"):
            path.unlink(missing_ok=True)

    def _prepare(self, resume: bool, overwrite: bool, config: dict[str, Any], *, same_weights: bool) -> None:
        """Create the manifest, or check the existing one: same layout always, same weights when ``same_weights``
        (a resumed collection)."""
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        manifest = json.loads(json.dumps({
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "created": utc_now(), "spec": self.spec.to_dict(),
            "shard_rows": self.shard_rows, "world_size": self.world_size, "environment": environment(),
            "config": config}))
        manifest["checksum"] = manifest_checksum(manifest)
        self._manifest = manifest
        if create_exclusive(self.root / MANIFEST, json_bytes(manifest)):
            return  # the first rank to arrive creates it; the others check it
        existing = self._read_manifest()
        if existing is None:
            raise StoreError(f"{self.root}/{MANIFEST} vanished while opening the store (another run deleting it?)")
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
        stored, mine = other.model.get("weights"), self.spec.model.get("weights")
        if same_weights and stored and mine and other.model.get("scheme") != self.spec.model.get("scheme"):
            raise SpecMismatch(f"store {self.root} records a {other.model.get('scheme', 'legacy')} weights "
                               f"fingerprint, this run's is {self.spec.model.get('scheme', 'legacy')}: they cannot be "
                               "compared. Fingerprint the model like the store (gradtrace.store.spec.fingerprint_like; "
                               "StoreWriter, and so collect, does), or pass mixed_weights=True")
        if same_weights and stored and mine and stored != mine:
            raise SpecMismatch(f"store {self.root} was collected with other model weights (fingerprint {stored}, "
                               f"this model's is {mine}); its rows and this run's would not be comparable. Resume "
                               "with the weights that started it, or write to a new directory or pass "
                               "overwrite=True")
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

    def _scan_existing(self) -> list[dict[str, Any]]:
        """Read the ids (and digests) every rank committed, checked as a reader checks them (but for data
        checksums), into the ledger; returns this rank's shards (a record committed after the rank file's last
        update is adopted: the status written next lists it)."""
        shards, _, _ = scan_shards(self.root, self._manifest, verify=False,
                                   where=f" in {self.root} (remove that shard or pass overwrite=True)")
        committed = []
        for shard in shards:
            self.ledger.add_existing(shard.record["ids"], (shard.record.get("fields") or {}).get("digest"))
            if shard.rank == self.rank:
                committed.append(shard.entry)
        return committed

    def _load_previous_skips(self) -> None:
        """Keep the non-finite ids an earlier run of this rank recorded (they are in no shard)."""
        try:
            previous = json.loads(rank_file(self.root, self.rank).read_text()).get("skipped") or {}
        except (OSError, ValueError, AttributeError):
            return
        earlier = previous.get("nonfinite") if isinstance(previous, dict) else None
        if isinstance(earlier, list):
            self.ledger.skipped["nonfinite"] = [i for i in earlier if i not in self.ledger.ids]

    def _write_status(self, status: str, error: str | None = None) -> None:
        """Replace this rank's status file (atomically): status, counts, every committed shard, skips."""
        skipped = {k: (list(v) if isinstance(v, list) else v) for k, v in dict(self.skipped).items()}  # a snapshot
        atomic_write_json(rank_file(self.root, self.rank), {
            "rank": self.rank, "status": status, "rows": self.rows_written, "shards": self._shards.next_seq,
            "updated": utc_now(), "skipped": skipped, "error": error, "committed": list(self._shards.committed)})

    # -- writing ---------------------------------------------------------------------------------
    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None = None) -> list[int]:
        """Positions of the ``ids`` the store does not hold yet (first occurrence); the others are counted
        as skipped (``already_stored`` by an earlier run, or ``duplicate``) and from now on the kept ones are
        taken as stored (see :meth:`IdLedger.select_new`).

        ``digests``: content digest of each row (None where unknown). An id seen before with another digest
        raises :class:`IdCollision` (nothing of this call is taken as stored then)."""
        return self.ledger.select_new(ids, digests)

    def note_nonfinite(self, ids: Sequence[str]) -> None:
        """Record ids whose gradients held NaN/inf (not stored; listed in the rank status file)."""
        self.ledger.note_nonfinite(ids)

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
        fields = per_row_lists(fields or {})
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
        positions = self.ledger.finite_rows(ids, vectors, selected=selected)
        row_digests = fields.get("digest")
        keep = positions if selected else [positions[k] for k in self.select_new(
            [ids[p] for p in positions], None if row_digests is None else [row_digests[p] for p in positions])]
        if not keep:
            return
        owned = len(keep) < len(ids)  # the selected rows are a copy of the caller's
        if owned:
            vectors = vectors[torch.tensor(keep, device=vectors.device)]
            ids = [ids[p] for p in keep]
            fields = {k: [v[p] for p in keep] for k, v in fields.items()}
        if vectors.is_cuda and self._pinned is None:
            self._pinned = PinnedPool()
        # CUDA rows: encoded on the device, a non-blocking copy into a pinned buffer the thread waits on
        self._background.put((ids, to_host(vectors, self.spec.dtype, self._pinned, copy=not owned),
                               fields))
        if self._background.error is not None:  # the writer died while this put waited; the rows were not written
            self._raise_if_failed()

    def _write_rows(self, item: tuple[list[str], HostRows, dict[str, list]]) -> None:
        """The writer thread's step: wait for a batch's copy to the host, append it, hand its buffer back."""
        ids, host, fields = item
        try:
            self._shards.append(ids, host.wait(), fields)
        finally:
            host.release()

    def _raise_if_failed(self) -> None:
        error = self._background.error
        if error is not None:
            raise StoreWriteError(
                f"writing {self.root} failed: {_cause(error)}. {self.rows_written} rows of rank {self.rank} are "
                f"committed ({self._shards.next_seq} shards) and readable with GradientStore.open(..., "
                "allow_incomplete=True); rows queued after them are lost. Fix the cause and resume with resume=True"
            ) from error

    def close(self, complete: bool = True) -> None:
        """Write what is buffered, wait for the thread, and mark this rank complete (or interrupted).

        Raises :class:`StoreWriteError` when the background writer failed.
        """
        if self._closed:
            return
        self._closed = True
        self._background.close()
        try:
            if self._background.error is not None:
                # the disk may still be full: the status then stays "writing", which reads as incomplete too
                with contextlib.suppress(OSError):
                    self._write_status("failed", repr(self._background.error))
                self._raise_if_failed()
            status = "complete" if complete else "interrupted"
            try:
                self._write_status(status)
            except OSError as err:
                raise StoreWriteError(
                    f"could not mark rank {self.rank} of {self.root} {status} ({err}): its {self.rows_written} rows "
                    f"({self._shards.next_seq} shards) are committed and readable with GradientStore.open(..., "
                    "allow_incomplete=True); free space and resume with resume=True to complete it") from err
        finally:
            release_lock(self.root, self.rank)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc is None)


def _process_rank() -> tuple[int, int]:
    """``(rank, world size)`` of the running process group, or ``(0, 1)``: the writer's default shard namespace."""
    from ..common.ranks import rank_and_world  # the floor's helper

    return rank_and_world()


def _cause(error: BaseException) -> str:
    """What went wrong in words: ``No space left on device (ENOSPC)`` for an OSError, else ``repr(error)``."""
    if isinstance(error, OSError) and error.errno:
        return f"{error.strerror or os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})"
    return repr(error)
