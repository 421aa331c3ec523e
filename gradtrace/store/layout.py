"""On-disk layout of a gradient store: file names, atomic writes, checksums, locks.

::

    store/
      manifest.json              format, schema version, GradientSpec, shard size, world size, config
      rank-00000.json            one per writing rank: status ("writing" | "complete"), rows, skipped ids
      rank-00000.lock            held while a run writes rank 0 (pid and host inside)
      shards/
        r00000-000000.data       rows x dim in the storage dtype, C order (memory-mapped when read)
        r00000-000000.scale      int8 stores: one float32 scale per row
        r00000-000000.json       commit record: ids, per-row fields, file sizes and blake2b checksums

A shard exists once its ``.json`` commit record exists: data files are written to temporary names,
fsynced and renamed first, the record last. A killed writer leaves at most temporary files, which are
removed when the store is reopened; every committed shard stays readable.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

__all__ = [
    "DTYPES",
    "FORMAT",
    "MANIFEST",
    "SCHEMA_VERSION",
    "StoreError",
    "acquire_lock",
    "atomic_write_bytes",
    "atomic_write_json",
    "checksum",
    "lock_file",
    "rank_file",
    "release_lock",
    "shard_name",
]

FORMAT = "gradtrace-store"
SCHEMA_VERSION = 1
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


def checksum(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def file_checksum(path: Path, block: int = 16 * 2**20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync, rename: readers see all or nothing."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=False).encode())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(root: Path, rank: int) -> Path:
    """Take the write lock of ``rank``; a lock left by a dead process on this host is taken over."""
    path = lock_file(root, rank)
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            same_host = holder.get("host") == me["host"]
            if same_host and holder.get("pid") and not _pid_alive(int(holder["pid"])):
                path.unlink(missing_ok=True)  # stale: its writer died
                continue
            raise StoreError(
                f"{root} (rank {rank}) is being written by another run (pid {holder.get('pid')} on "
                f"{holder.get('host')}); two runs cannot write the same store. If that run is gone, delete {path}."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise StoreError(f"could not take the write lock {path}")


def release_lock(root: Path, rank: int) -> None:
    lock_file(root, rank).unlink(missing_ok=True)
