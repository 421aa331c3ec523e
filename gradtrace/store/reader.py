"""Reading gradient stores: one view over the memory-mapped shards of every rank."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .layout import (
    DTYPES,
    FORMAT,
    MANIFEST,
    SCHEMA_VERSION,
    StoreError,
    file_checksum,
    lock_is_stale,
    rank_file,
    read_lock,
)
from .spec import GradientSpec

__all__ = ["GradientStore", "Shard"]


@dataclass
class Shard:
    """One committed shard: ``rows`` rows starting at global row ``start``."""

    name: str
    rank: int
    seq: int
    start: int
    rows: int
    record: dict[str, Any]


class GradientStore:
    """A gradient store opened for reading.

    ``GradientStore.open(path)`` checks the store: the manifest's format and schema version, that every
    shard's files exist with their recorded sizes (a truncated shard is named), their checksums
    (``verify=True``, the default), and that every rank finished writing (``allow_incomplete=True`` reads
    what was committed by a run that died or is still going).

    Attributes:
        spec: the :class:`GradientSpec` of the vectors.
        ids: example id of each row, in row order (rank, then shard, then row).
        manifest: the parsed manifest; ``ranks``: status of each writing rank.
    """

    def __init__(self, root: Path, manifest: dict[str, Any], shards: list[Shard], ranks: dict[int, dict]) -> None:
        self.root = root
        self.manifest = manifest
        self.spec = GradientSpec.from_dict(manifest["spec"])
        self.shards = shards
        self.ranks = ranks
        self.ids: list[str] = [i for s in shards for i in s.record["ids"]]
        self._index: dict[str, int] | None = None
        self._maps: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True, allow_incomplete: bool = False) -> GradientStore:
        root = Path(path)
        if not root.is_dir():
            raise StoreError(f"{root} is not a gradient store (no such directory)")
        manifest_path = root / MANIFEST
        if not manifest_path.exists():
            raise StoreError(f"{root} is not a gradient store (no {MANIFEST})")
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as err:
            raise StoreError(f"{manifest_path} is corrupted: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise StoreError(f"{root} is not a gradtrace store (format {found!r})")
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(f"{root} has schema version {manifest.get('schema_version')}, this gradtrace reads "
                             f"version {SCHEMA_VERSION}")
        try:
            spec = GradientSpec.from_dict(manifest["spec"])
            world_size = int(manifest.get("world_size", 1))
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError(f"{manifest_path} is corrupted: no valid spec ({err!r})") from None
        if spec.dtype not in DTYPES:
            raise StoreError(f"{manifest_path} names an unknown storage dtype {spec.dtype!r}")
        shards, start = [], 0
        for record_path in sorted((root / "shards").glob("r*.json")):
            try:
                record = json.loads(record_path.read_text())
                shard = Shard(record["name"], int(record["rank"]), int(record["seq"]), 0, int(record["rows"]),
                              record)
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise StoreError(f"shard record {record_path.name} is corrupted: {err!r}") from None
            cls._check_shard(root, record, spec, verify)
            shards.append(shard)
        shards.sort(key=lambda s: (s.rank, s.seq))
        for shard in shards:
            shard.start, start = start, start + shard.rows
        # ranks of the manifest, plus any that left a status file or shards (a resume on more ranks)
        rank_ids = set(range(world_size)) | {s.rank for s in shards}
        for status_path in root.glob("rank-*.json"):
            with contextlib.suppress(ValueError, IndexError):
                rank_ids.add(int(status_path.stem.split("-")[1]))
        ranks = {}
        for r in sorted(rank_ids):
            path_r = rank_file(root, r)
            try:
                ranks[r] = json.loads(path_r.read_text()) if path_r.exists() else {"rank": r, "status": "missing"}
            except ValueError as err:
                raise StoreError(f"rank status file {path_r.name} is corrupted: {err}") from None
        unfinished = {r: s.get("status") for r, s in ranks.items() if s.get("status") != "complete"}
        if unfinished and not allow_incomplete:
            detail = ", ".join(f"rank {r}: {s}{cls._writer_state(root, r)}" for r, s in unfinished.items())
            raise StoreError(
                f"{root} is incomplete ({detail}): its writer did not finish. {start} committed rows are readable "
                "with GradientStore.open(..., allow_incomplete=True); resume the run to complete it")
        return cls(root, manifest, shards, ranks)

    @staticmethod
    def _writer_state(root: Path, rank: int) -> str:
        holder = read_lock(root, rank)
        if not holder:
            return ""
        state = "gone" if lock_is_stale(holder) else "still holds the lock"
        return f", writer pid {holder.get('pid')} on {holder.get('host')} {state}"

    @staticmethod
    def _check_shard(root: Path, record: dict, spec: GradientSpec, verify: bool) -> None:
        name = record.get("name", "?")
        if record.get("dim") != spec.dim or record.get("dtype") != spec.dtype:
            raise StoreError(f"shard {name} holds dim {record.get('dim')} {record.get('dtype')}, the manifest says "
                             f"{spec.dim} {spec.dtype}")
        if not isinstance(record.get("ids"), list) or len(record["ids"]) != record.get("rows"):
            raise StoreError(f"shard {name}: {len(record.get('ids') or [])} ids for {record.get('rows')} rows")
        for key, values in (record.get("fields") or {}).items():
            if len(values) != record["rows"]:
                raise StoreError(f"shard {name}: field {key!r} has {len(values)} values for {record['rows']} rows")
        itemsize = DTYPES[spec.dtype][1]
        expected = {"data": record["rows"] * spec.dim * itemsize}
        if spec.dtype == "int8":
            expected["scale"] = record["rows"] * 4
        files = record.get("files")
        if not isinstance(files, dict):
            raise StoreError(f"shard {name}: its record lists no files")
        for key, size in expected.items():
            info = files.get(key)
            if info is None:
                raise StoreError(f"shard {name} has no {key} file")
            file = root / "shards" / info["name"]
            if not file.exists():
                raise StoreError(f"shard {name}: {info['name']} is missing")
            actual = file.stat().st_size
            if actual != size or info["bytes"] != size:
                raise StoreError(f"shard {name}: {info['name']} is truncated or damaged ({actual} bytes, expected "
                                 f"{size})")
            if verify and file_checksum(file) != info["blake2b"]:
                raise StoreError(f"shard {name}: {info['name']} is corrupted (checksum mismatch)")

    # -- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def complete(self) -> bool:
        return all(s.get("status") == "complete" for s in self.ranks.values())

    def index_of(self, ids: Sequence[str]) -> list[int]:
        """Row numbers of ``ids`` (KeyError naming the first unknown id)."""
        if self._index is None:
            index: dict[str, int] = {}
            for row, ident in enumerate(self.ids):
                index.setdefault(ident, row)
            self._index = index
        try:
            return [self._index[str(i)] for i in ids]
        except KeyError as err:
            raise KeyError(f"id {err.args[0]!r} is not in store {self.root}") from None

    def field(self, name: str) -> list[Any]:
        """A per-row field (e.g. ``"step"``) over all rows (None where a shard lacks it)."""
        return [v for s in self.shards for v in s.record.get("fields", {}).get(name, [None] * s.rows)]

    def _arrays(self, shard: Shard) -> tuple[np.ndarray, np.ndarray | None]:
        if shard.name not in self._maps:
            np_dtype = DTYPES[self.spec.dtype][0]
            if shard.rows * self.spec.dim == 0:  # an empty file cannot be memory-mapped
                empty = np.zeros((shard.rows, self.spec.dim), dtype=np_dtype)
                self._maps[shard.name] = (empty, np.zeros(shard.rows, dtype=np.float32))
                return self._maps[shard.name]
            data = np.memmap(self.root / "shards" / shard.record["files"]["data"]["name"], dtype=np_dtype,
                             mode="r", shape=(shard.rows, self.spec.dim))
            scale = None
            if self.spec.dtype == "int8":
                scale = np.memmap(self.root / "shards" / shard.record["files"]["scale"]["name"], dtype=np.float32,
                                  mode="r", shape=(shard.rows,))
            self._maps[shard.name] = (data, scale)
        return self._maps[shard.name]

    def _decode(self, shard: Shard, rows: slice | np.ndarray) -> Tensor:
        """Rows of one shard (a slice or an index array) as float32 ``[n, dim]``."""
        data, scale = self._arrays(shard)
        block = torch.from_numpy(np.array(data[rows]))
        if self.spec.dtype == "bfloat16":
            return block.view(torch.bfloat16).to(torch.float32)
        if self.spec.dtype == "int8":
            return block.to(torch.float32) * torch.from_numpy(np.array(scale[rows])).unsqueeze(1)
        return block

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor:
        """Rows ``start:stop`` as a float32 ``[n, dim]`` tensor."""
        start, stop = max(0, start), min(len(self), stop)
        parts = []
        for shard in self.shards:
            lo, hi = max(start, shard.start), min(stop, shard.start + shard.rows)
            if lo < hi:
                parts.append(self._decode(shard, slice(lo - shard.start, hi - shard.start)))
        out = torch.cat(parts) if parts else torch.zeros(0, self.dim)
        return out.to(device) if device is not None else out

    def rows(self, index: Sequence[int], device: torch.device | str | None = None) -> Tensor:
        """The rows at ``index`` (any order, repeats allowed) as float32 ``[len(index), dim]``."""
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            bad = int(rows[(rows < 0) | (rows >= len(self))][0])
            raise IndexError(f"row {bad} is out of range for store {self.root} with {len(self)} rows")
        out = torch.empty(len(rows), self.dim)
        starts = np.array([s.start for s in self.shards], dtype=np.int64)
        which = np.searchsorted(starts, rows, side="right") - 1
        for k in np.unique(which):
            shard = self.shards[int(k)]
            positions = np.nonzero(which == k)[0]
            out[torch.from_numpy(positions)] = self._decode(shard, rows[positions] - shard.start)
        return out.to(device) if device is not None else out

    def iter_blocks(self, block_rows: int = 8192, device: torch.device | str | None = None
                    ) -> Iterator[tuple[int, Tensor]]:
        """``(first row, [n, dim] float32)`` blocks of at most ``block_rows`` rows, in row order."""
        for start in range(0, len(self), block_rows):
            yield start, self.read(start, start + block_rows, device)

    def info(self) -> dict[str, Any]:
        """A summary for ``gradtrace inspect``."""
        return {"path": str(self.root), "rows": len(self), "dim": self.dim, "dtype": self.spec.dtype,
                "params": len(self.spec.params), "projection": self.spec.projection,
                "convention": self.spec.convention, "model": self.spec.model, "shards": len(self.shards),
                "ranks": {r: s.get("status") for r, s in self.ranks.items()},
                "bytes": sum(sum(f["bytes"] for f in s.record["files"].values()) for s in self.shards),
                "created": self.manifest.get("created"), "config": self.manifest.get("config", {})}

    def __repr__(self) -> str:
        return (f"GradientStore({str(self.root)!r}, rows={len(self)}, dim={self.dim}, dtype={self.spec.dtype}, "
                f"shards={len(self.shards)}, complete={self.complete})")
