"""The shard files of one rank: how many rows a shard takes, the open shard's files, and committing it.

A shard is written as it fills: each batch is quantized and appended to the open shard's temporary files
(checksummed as they grow); a full shard is committed (files fsynced and renamed, then its ``.json`` record:
the commit point). :class:`ShardSeries` is the writer thread's side of :class:`~gradtrace.store.ShardWriter`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from ..grad.quantize import QuantizedRows, quantize
from .artifact import atomic_write_json, checksum, fsync_dir, json_bytes
from .layout import DTYPES, shard_name
from .spec import GradientSpec

__all__ = ["DEFAULT_MAX_SHARD_ROWS", "DEFAULT_SHARD_BYTES", "ShardSeries", "row_bytes", "rows_per_shard", "utc_now"]

DEFAULT_SHARD_BYTES = 256 * 2**20
"""Default size of a shard's files (data + scales): what a hard kill can lose at most."""

DEFAULT_MAX_SHARD_ROWS = 65536
"""With the default shard size, rows per shard are capped too: a shard's ids and per-row fields are held in
memory until its record is written, so small rows must not make a shard of millions of ids."""

_QUANT_MODE = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}


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
        fsync_dir(next(iter(self.final.values())).parent)
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


def utc_now() -> str:
    """The time stamp records and status files carry (UTC, seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ShardSeries:
    """The shards one rank appends to: the open one, and the committed ones its rank file lists.

    ``committed``: this rank's shards found on disk (``{"name", "rows", "record"}`` each, in order);
    ``on_commit()`` runs after each commit (the writer rewrites the rank file). Used by one thread only.
    """

    def __init__(self, root: Path, rank: int, spec: GradientSpec, shard_rows: int, committed: list[dict[str, Any]],
                 on_commit: Callable[[], None]) -> None:
        self.root, self.rank, self.spec, self.shard_rows = root, rank, spec, shard_rows
        self.committed = committed
        self.next_seq = len(committed)
        self.rows = sum(entry["rows"] for entry in committed)
        self._on_commit = on_commit
        self._open: _OpenShard | None = None

    def append(self, ids: list[str], rows: Tensor | QuantizedRows, fields: dict[str, list]) -> None:
        """Quantize one batch's ``rows`` ``[n, dim]`` float32 (or take them encoded already, on the host:
        :func:`~gradtrace.store.transfer.encode_rows`) and append them to the open shard(s), committing each shard
        that fills up."""
        done = 0
        while done < len(ids):
            if self._open is None:
                self._open = _OpenShard(self.root / "shards", shard_name(self.rank, self.next_seq), self.next_seq,
                                        scaled=self.spec.dtype == "int8")
            shard = self._open
            take = min(len(ids) - done, self.shard_rows - shard.rows)
            part = slice(done, done + take)
            q = (QuantizedRows(rows.data[part], None if rows.scale is None else rows.scale[part], rows.mode)
                 if isinstance(rows, QuantizedRows) else quantize(rows[part], _QUANT_MODE[self.spec.dtype]))
            shard.append("data", q.data.view(torch.int16) if q.data.dtype == torch.bfloat16 else q.data)
            if q.scale is not None:
                shard.append("scale", q.scale.to(torch.float32))
            shard.add_rows(ids[part], {k: v[part] for k, v in fields.items()})
            done += take
            if shard.rows == self.shard_rows:
                self.commit()

    def commit(self) -> None:
        """Commit the open shard (if any): files renamed to their names, then its record (the commit point), then
        ``on_commit`` (the rank file listing it; a crash before that: the record is adopted by the next writer)."""
        shard, self._open = self._open, None
        if shard is None:
            return
        try:
            files = shard.finish()
        except BaseException:
            shard.abandon()
            raise
        record = {"name": shard.name, "rank": self.rank, "seq": shard.seq, "rows": shard.rows, "dim": self.spec.dim,
                  "dtype": self.spec.dtype, "files": files, "ids": shard.ids, "fields": shard.fields,
                  "written": utc_now()}
        atomic_write_json(self.root / "shards" / f"{shard.name}.json", record)  # the commit point
        self.committed.append({"name": shard.name, "rows": shard.rows, "record": checksum(json_bytes(record))})
        self.next_seq += 1
        self.rows += shard.rows
        self._on_commit()

    def abandon(self) -> None:
        """Drop the open shard's temporary files (after a failure: no partial shard is left behind)."""
        if self._open is not None:
            self._open.abandon()
            self._open = None
