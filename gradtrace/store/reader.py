"""Reading gradient stores: one view over the memory-mapped shards of every rank."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .layout import DTYPES, FORMAT, MANIFEST, SCHEMA_VERSION, StoreError, file_checksum, rank_file
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
        manifest_path = root / MANIFEST
        if not manifest_path.exists():
            raise StoreError(f"{root} is not a gradient store (no {MANIFEST})")
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as err:
            raise StoreError(f"{manifest_path} is corrupted: {err}") from None
        if manifest.get("format") != FORMAT:
            raise StoreError(f"{root} is not a gradtrace store (format {manifest.get('format')!r})")
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(f"{root} has schema version {manifest.get('schema_version')}, this gradtrace reads "
                             f"version {SCHEMA_VERSION}")
        spec = GradientSpec.from_dict(manifest["spec"])
        ranks = {}
        for r in range(int(manifest.get("world_size", 1))):
            path_r = rank_file(root, r)
            ranks[r] = json.loads(path_r.read_text()) if path_r.exists() else {"rank": r, "status": "missing"}
        unfinished = {r: s.get("status") for r, s in ranks.items() if s.get("status") != "complete"}
        shards, start = [], 0
        for record_path in sorted((root / "shards").glob("r*.json")):
            try:
                record = json.loads(record_path.read_text())
            except ValueError as err:
                raise StoreError(f"shard record {record_path.name} is corrupted: {err}") from None
            cls._check_shard(root, record, spec, verify)
            shards.append(Shard(record["name"], record["rank"], record["seq"], start, record["rows"], record))
            start += record["rows"]
        if unfinished and not allow_incomplete:
            detail = ", ".join(f"rank {r}: {s}" for r, s in unfinished.items())
            raise StoreError(
                f"{root} is incomplete ({detail}): its writer did not finish. {start} committed rows are readable "
                "with GradientStore.open(..., allow_incomplete=True); resume the run to complete it")
        return cls(root, manifest, shards, ranks)

    @staticmethod
    def _check_shard(root: Path, record: dict, spec: GradientSpec, verify: bool) -> None:
        name = record.get("name", "?")
        if record.get("dim") != spec.dim or record.get("dtype") != spec.dtype:
            raise StoreError(f"shard {name} holds dim {record.get('dim')} {record.get('dtype')}, the manifest says "
                             f"{spec.dim} {spec.dtype}")
        if len(record.get("ids", [])) != record.get("rows"):
            raise StoreError(f"shard {name}: {len(record.get('ids', []))} ids for {record.get('rows')} rows")
        itemsize = DTYPES[spec.dtype][1]
        expected = {"data": record["rows"] * spec.dim * itemsize}
        if spec.dtype == "int8":
            expected["scale"] = record["rows"] * 4
        for key, size in expected.items():
            info = record["files"].get(key)
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
            self._index = {ident: row for row, ident in enumerate(self.ids)}
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
            data = np.memmap(self.root / "shards" / shard.record["files"]["data"]["name"], dtype=np_dtype,
                             mode="r", shape=(shard.rows, self.spec.dim))
            scale = None
            if self.spec.dtype == "int8":
                scale = np.memmap(self.root / "shards" / shard.record["files"]["scale"]["name"], dtype=np.float32,
                                  mode="r", shape=(shard.rows,))
            self._maps[shard.name] = (data, scale)
        return self._maps[shard.name]

    def _decode(self, shard: Shard, lo: int, hi: int) -> Tensor:
        data, scale = self._arrays(shard)
        block = torch.from_numpy(np.array(data[lo:hi]))
        if self.spec.dtype == "bfloat16":
            return block.view(torch.bfloat16).to(torch.float32)
        if self.spec.dtype == "int8":
            return block.to(torch.float32) * torch.from_numpy(np.array(scale[lo:hi])).unsqueeze(1)
        return block

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor:
        """Rows ``start:stop`` as a float32 ``[n, dim]`` tensor."""
        start, stop = max(0, start), min(len(self), stop)
        parts = []
        for shard in self.shards:
            lo, hi = max(start, shard.start), min(stop, shard.start + shard.rows)
            if lo < hi:
                parts.append(self._decode(shard, lo - shard.start, hi - shard.start))
        out = torch.cat(parts) if parts else torch.zeros(0, self.dim)
        return out.to(device) if device is not None else out

    def rows(self, index: Sequence[int], device: torch.device | str | None = None) -> Tensor:
        """The rows at ``index`` (any order) as float32 ``[len(index), dim]``."""
        out = torch.empty(len(index), self.dim)
        for pos, row in enumerate(index):
            out[pos] = self.read(row, row + 1)[0]
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
