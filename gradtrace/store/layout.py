"""On-disk layout of a gradient store: file names, manifest checksum, locks (atomic writes and checksums:
:mod:`gradtrace.store.artifact`, shared with curvature and scores).

::

    store/
      manifest.json              format, schema version, GradientSpec, shard size, world size, config,
                                 and (schema 2) the blake2b checksum of all of that but the config
      rank-00000.json            one per writing rank: status ("writing" | "complete" | ...), rows, skipped ids,
                                 and (schema 2) ``committed``: every shard of the rank in order, with its rows
                                 and the blake2b checksum of its record
      rank-00000.lock            held while a run writes rank 0 (pid and host inside)
      shards/
        r00000-000000.data       rows x dim in the storage dtype, C order (memory-mapped when read)
        r00000-000000.scale      int8 stores: one float32 scale per row
        r00000-000000.json       commit record: ids, per-row fields, file sizes and blake2b checksums

A shard exists once its ``.json`` commit record exists: data files are written to temporary names,
fsynced and renamed first, the record next, and the rank file listing it last. A killed writer leaves at
most temporary files, data files without a record (removed by the next writer of that rank) and one
record not yet listed in its rank file (the next one in sequence: adopted by readers of an unfinished
rank and by the resuming writer). Every committed shard stays readable. The manifest and lock files are
created whole (written aside, then hard-linked into place). A lock names its holder's pid and host; a
lock whose process is gone (same host) is taken over.

Schema versions: 2 is written. 1 (no manifest checksum, no shard list in the rank file) is still read,
with the checks its files allow (contiguous shards, row and shard counts of finished ranks, unique ids,
data checksums); it cannot be resumed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .artifact import canonical_json, checksum
from .locking import LockedError, acquire, lock_is_stale, read_holder, release

__all__ = [
    "DTYPES",
    "FORMAT",
    "MANIFEST",
    "MANIFEST_UNSEALED",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "SHARD_FILE",
    "StoreError",
    "acquire_lock",
    "lock_file",
    "lock_is_stale",
    "manifest_checksum",
    "rank_file",
    "read_lock",
    "release_lock",
    "shard_name",
]

FORMAT = "gradtrace-store"
SCHEMA_VERSION = 2
"""The schema version this gradtrace writes."""
READABLE_VERSIONS = (1, 2)
"""Schema versions this gradtrace reads (see the module docstring for what version 1 lacks)."""
SHARD_FILE = re.compile(r"r(\d{5})-(\d{6})\.(json|data|scale)")
"""File names a store's ``shards/`` directory may hold (besides ``.tmp-`` files of a running writer)."""
MANIFEST = "manifest.json"
DTYPES = {"float32": ("float32", 4), "bfloat16": ("int16", 2), "int8": ("int8", 1)}
"""storage dtype -> (numpy dtype of the raw file, bytes per value); bf16 is kept as raw 16-bit words."""


class StoreError(RuntimeError):
    """A store is missing, corrupted, incomplete, locked or does not match what it is used with."""


def shard_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}"


def rank_file(root: Path, rank: int) -> Path:
    return root / f"rank-{rank:05d}.json"


def lock_file(root: Path, rank: int) -> Path:
    return root / f"rank-{rank:05d}.lock"


MANIFEST_UNSEALED = ("checksum", "config")
"""Manifest keys its checksum does not cover: itself, and the free-form ``config`` (provenance that tools
such as the Trainer integration update after the store is created; it does not change how rows are read)."""


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """Checksum of what a manifest says about its rows: every key but :data:`MANIFEST_UNSEALED` (format,
    schema version, spec, shard size, world size, creation time); key order and formatting do not matter."""
    body = {k: v for k, v in manifest.items() if k not in MANIFEST_UNSEALED}
    return checksum(canonical_json(body))


def read_lock(root: Path, rank: int) -> dict[str, Any] | None:
    """The holder recorded in the lock file of ``rank`` (``{"pid", "host"}``), or None when unlocked."""
    return read_holder(lock_file(root, rank))


def acquire_lock(root: Path, rank: int) -> Path:
    """Take the write lock of ``rank``; a lock left by a dead process on this host is taken over."""
    path = lock_file(root, rank)
    try:
        acquire(path, f"rank {rank} of a gradient store",
                f"{root} (rank {rank}) is being written by another run ({{holder}}); two runs cannot write the "
                "same store.")
    except LockedError as err:
        raise StoreError(str(err)) from None
    return path


def release_lock(root: Path, rank: int) -> None:
    """Remove the lock of ``rank`` if this process holds it."""
    release(lock_file(root, rank))
