"""Reading gradient stores: one view over the memory-mapped shards of every rank."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .artifact import checksum, file_checksum
from .layout import (
    DTYPES,
    MANIFEST,
    SHARD_FILE,
    StoreError,
    lock_is_stale,
    rank_file,
    read_lock,
    shard_name,
)
from .manifest import check_manifest, read_manifest
from .spec import GradientSpec

__all__ = ["GradientStore", "Shard", "check_manifest", "read_manifest", "scan_shards"]


@dataclass
class Shard:
    """One committed shard: ``rows`` rows starting at global row ``start``.

    ``entry``: how the rank file lists it (``{"name", "rows", "record"}``, the record's blake2b checksum).
    ``listed``: False for a record committed after its rank file was last written (adopted, see the layout).
    """

    name: str
    rank: int
    seq: int
    start: int
    rows: int
    record: dict[str, Any]
    entry: dict[str, Any] | None = None
    listed: bool = True


def _status(root: Path, rank: int) -> dict[str, Any]:
    path = rank_file(root, rank)
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        return {"rank": rank, "status": "missing"}
    except ValueError as err:
        raise StoreError(f"rank status file {path.name} is corrupted: {err}") from None
    if not isinstance(status, dict):
        raise StoreError(f"rank status file {path.name} is corrupted: not a JSON object")
    return status


def _shard_files(root: Path) -> tuple[dict[int, dict[int, set[str]]], list[str]]:
    """``{rank: {seq: {"json", "data", ...}}}`` of the shard files in ``shards/``, and the unknown names."""
    found: dict[int, dict[int, set[str]]] = {}
    unknown = []
    shards = root / "shards"
    for path in shards.iterdir() if shards.is_dir() else ():
        match = SHARD_FILE.fullmatch(path.name)
        if match is None:
            if not path.name.startswith(".tmp-"):  # a running (or killed) writer's temporary file
                unknown.append(path.name)
            continue
        rank, seq, kind = int(match[1]), int(match[2]), match[3]
        found.setdefault(rank, {}).setdefault(seq, set()).add(kind)
    return found, unknown


def _read_record(root: Path, rank: int, seq: int, where: str = "") -> tuple[bytes, dict[str, Any]]:
    name = shard_name(rank, seq)
    path = root / "shards" / f"{name}.json"
    raw = path.read_bytes()
    try:
        record = json.loads(raw)
        if not isinstance(record, dict):
            raise TypeError("not a JSON object")
        missing = [key for key in ("name", "rank", "seq", "rows") if key not in record]
        if missing or not isinstance(record["rows"], int) or record["rows"] < 0:
            raise KeyError(missing[0] if missing else "rows")
    except (ValueError, KeyError, TypeError) as err:
        raise StoreError(f"shard record {path.name}{where} is corrupted: {err!r}") from None
    if (record["name"], record["rank"], record["seq"]) != (name, rank, seq):
        raise StoreError(f"shard record {path.name} describes shard {record['name']!r} (rank {record['rank']}, "
                         f"seq {record['seq']}): a record copied or renamed from another shard; remove it")
    return raw, record


def _rank_shards(root: Path, rank: int, status: dict[str, Any], seqs: dict[int, set[str]], version: int,
                 where: str = "") -> list[Shard]:
    """The committed shards of ``rank``, checked against its rank file (see the layout for the rules)."""
    records = sorted(seq for seq, kinds in seqs.items() if "json" in kinds)
    complete = status.get("status") == "complete"
    rank_path = rank_file(root, rank).name
    shards: list[Shard] = []
    listed = status.get("committed")
    if version >= 2 and listed is None and not complete:
        listed = []  # an unfinished rank whose status was written before its first shard: all records are a tail
    if version >= 2 and status.get("status") != "missing":
        if not isinstance(listed, list) or not all(
                isinstance(e, dict) and isinstance(e.get("rows"), int) and isinstance(e.get("record"), str)
                for e in listed):
            raise StoreError(f"rank status file {rank_path} is corrupted: no valid list of committed shards")
        have = set(records)
        for seq, entry in enumerate(listed):
            name = shard_name(rank, seq)
            if entry.get("name") != name:
                raise StoreError(f"rank status file {rank_path} is corrupted: it lists {entry.get('name')!r} as "
                                 f"shard {seq} of rank {rank} (expected {name})")
            if seq not in have:
                raise StoreError(f"shard {name} is missing: {rank_path} lists it ({entry.get('rows')} rows) but "
                                 f"shards/{name}.json is gone; those rows are lost. Restore the file or collect "
                                 "the store again (overwrite=True)")
            raw, record = _read_record(root, rank, seq, where)
            if checksum(raw) != entry.get("record") or record["rows"] != entry.get("rows"):
                raise StoreError(f"shard record {name}.json does not match its checksum in {rank_path}: it was "
                                 "edited or is corrupted (its ids, fields or file list cannot be trusted). Restore "
                                 "it or collect the store again")
            shards.append(Shard(name, rank, seq, 0, int(record["rows"]), record, dict(entry)))
        if "committed" in status and (sum(e.get("rows", 0) for e in listed) != status.get("rows")
                                      or len(listed) != status.get("shards")):
            raise StoreError(f"rank status file {rank_path} is corrupted: {status.get('rows')} rows in "
                             f"{status.get('shards')} shards, but it lists {len(listed)} shards with "
                             f"{sum(e.get('rows', 0) for e in listed)} rows")
    elif version < 2 and complete and len(records) != status.get("shards"):  # schema 1: counts are all there is
        raise StoreError(f"{root} lost or gained shards: {rank_path} says rank {rank} committed "
                         f"{status.get('shards')} shards, shards/ holds {len(records)} records of it")
    # records after the listed ones: the next in sequence, committed before the rank file was updated
    for seq in records[len(shards):]:
        name = shard_name(rank, seq)
        if seq != len(shards):
            missing = shard_name(rank, len(shards))
            raise StoreError(f"shard {missing} is missing: shards/ holds {name}.json but not {missing}.json "
                             f"(rank {rank}'s shards must be numbered without gaps); restore it or collect the "
                             "store again")
        if version >= 2 and complete:
            raise StoreError(f"shard record {name}.json is not listed in {rank_path}, which says rank {rank} "
                             "finished: a copied or foreign shard. Remove it (the listed shards are intact)")
        raw, record = _read_record(root, rank, seq, where)
        entry = {"name": name, "rows": int(record["rows"]), "record": checksum(raw)}
        shards.append(Shard(name, rank, seq, 0, int(record["rows"]), record, entry, listed=version < 2))
    if version < 2 and complete and sum(s.rows for s in shards) != status.get("rows"):
        raise StoreError(f"{root}: the shards of rank {rank} hold {sum(s.rows for s in shards)} rows, {rank_path} "
                         f"says {status.get('rows')}: a shard was edited, lost or added")
    return shards


def _check_shard(root: Path, shard: Shard, spec: GradientSpec, verify: bool) -> None:
    """A record's own consistency and its files: names confined to the shard, sizes, checksums."""
    record, name = shard.record, shard.name
    if record.get("dim") != spec.dim or record.get("dtype") != spec.dtype:
        raise StoreError(f"shard {name} holds dim {record.get('dim')} {record.get('dtype')}, the manifest says "
                         f"{spec.dim} {spec.dtype}")
    ids = record.get("ids")
    if not isinstance(ids, list) or len(ids) != shard.rows or not all(isinstance(i, str) for i in ids):
        count = len(ids) if isinstance(ids, list) else 0
        raise StoreError(f"shard {name}: {count} string ids for {shard.rows} rows")
    fields = record.get("fields") or {}
    if not isinstance(fields, dict):
        raise StoreError(f"shard {name}: its per-row fields are corrupted")
    for key, values in fields.items():
        if not isinstance(values, list) or len(values) != shard.rows:
            count = len(values) if isinstance(values, list) else 0
            raise StoreError(f"shard {name}: field {key!r} has {count} values for {shard.rows} rows")
    itemsize = DTYPES[spec.dtype][1]
    expected = {"data": shard.rows * spec.dim * itemsize}
    if spec.dtype == "int8":
        expected["scale"] = shard.rows * 4
    files = record.get("files")
    if not isinstance(files, dict):
        raise StoreError(f"shard {name}: its record lists no files")
    for key, size in expected.items():
        info = files.get(key)
        if not isinstance(info, dict):
            raise StoreError(f"shard {name} has no {key} file")
        if info.get("name") != f"{name}.{key}":
            raise StoreError(f"shard {name}: its record names {info.get('name')!r} as its {key} file; a record may "
                             f"only name its own files ({name}.{key} in shards/). Restore the record")
        file = root / "shards" / info["name"]
        if not file.exists():
            raise StoreError(f"shard {name}: {info['name']} is missing")
        actual = file.stat().st_size
        if actual != size or info.get("bytes") != size:
            raise StoreError(f"shard {name}: {info['name']} is truncated or damaged ({actual} bytes, expected "
                             f"{size})")
        if verify and file_checksum(file) != info.get("blake2b"):
            raise StoreError(f"shard {name}: {info['name']} is corrupted (checksum mismatch)")


def _check_unique_ids(root: Path, shards: list[Shard]) -> int:
    """Refuse an id stored twice by one rank, or for two different contents (content digests); the same id
    stored by two ranks that did not see each other (e.g. a sampler padding its last batch with repeats) is
    kept unless both rows' digests are known and differ. Returns the number of such repeats."""
    ids = [i for s in shards for i in s.record["ids"]]
    if len(set(ids)) == len(ids):
        return 0
    first: dict[str, tuple[Shard, str | None]] = {}
    repeats = 0
    for shard in shards:
        digests = (shard.record.get("fields") or {}).get("digest") or [None] * shard.rows
        for ident, digest in zip(shard.record["ids"], digests):
            if ident not in first:
                first[ident] = (shard, digest)
                continue
            other, known = first[ident]
            collision = digest is not None and known is not None and digest != known
            if other.rank == shard.rank or collision:
                what = ("two different examples share this id (their content digests differ)" if collision else
                        "a rank stores each example once: a shard was copied or the store was edited")
                raise StoreError(f"{root}: id {ident!r} is stored twice (shards {other.name} and {shard.name}); "
                                 f"{what}. Collect the store again")
            repeats += 1
    return repeats


def scan_shards(root: Path, manifest: dict[str, Any], *, verify: bool, where: str = ""
                ) -> tuple[list[Shard], dict[int, dict], int]:
    """The committed shards of every rank in row order (with their start rows), the status of every rank, and
    the number of ids stored by two ranks with the same content. Raises :class:`StoreError` naming the first
    thing that is wrong (``where`` is added after a corrupted record's name); unknown files in ``shards/``
    are ignored with a warning."""
    spec = GradientSpec.from_dict(manifest["spec"])
    version = int(manifest["schema_version"])
    rank_ids = set(range(int(manifest.get("world_size", 1))))
    for status_path in root.glob("rank-*.json"):  # rank files first: shards committed later are a tail
        stem = status_path.stem.split("-")
        if len(stem) == 2 and stem[1].isdigit():
            rank_ids.add(int(stem[1]))
    ranks = {r: _status(root, r) for r in sorted(rank_ids)}
    files, unknown = _shard_files(root)
    for r in sorted(set(files) - set(ranks)):  # a rank that left shards but no status file
        ranks[r] = {"rank": r, "status": "missing"}
    shards: list[Shard] = []
    for r in sorted(ranks):
        mine = _rank_shards(root, r, ranks[r], files.get(r, {}), version, where)
        shards += mine
        if ranks[r].get("status") == "complete":  # data files no record names: left over, never read
            unknown += [f"{shard_name(r, seq)}.{k}" for seq, kinds in files.get(r, {}).items()
                        if seq >= len(mine) for k in sorted(kinds)]
    if unknown:
        warnings.warn(f"gradtrace: {root}/shards holds {len(unknown)} file(s) that are no part of the store, "
                      f"ignored: {sorted(unknown)[:5]}", stacklevel=3)
    start = 0
    for shard in shards:
        _check_shard(root, shard, spec, verify)
        shard.start, start = start, start + shard.rows
    return shards, ranks, _check_unique_ids(root, shards)


class GradientStore:
    """A gradient store opened for reading.

    ``GradientStore.open(path)`` checks the store (see ``docs/store.md``): the manifest's format, schema
    version and checksum; that every rank's shards are exactly those its rank file lists (none missing,
    added, renamed or edited: record checksums), numbered without gaps; that ids are unique; that every
    shard's files are its own and have their recorded sizes (a truncated shard is named); their data
    checksums (``verify=True``, the default); and that every rank finished writing (``allow_incomplete=True``
    reads what was committed by a run that died or is still going).

    Attributes:
        spec: the :class:`GradientSpec` of the vectors.
        ids: example id of each row, in row order (rank, then shard, then row).
        manifest: the parsed manifest; ``ranks``: status of each writing rank.
        repeats: ids stored by two ranks with the same content (``index_of`` gives the first row).
    """

    def __init__(self, root: Path, manifest: dict[str, Any], shards: list[Shard], ranks: dict[int, dict],
                 repeats: int = 0) -> None:
        self.root = root
        self.manifest = manifest
        self.spec = GradientSpec.from_dict(manifest["spec"])
        self.shards = shards
        self.ranks = ranks
        self.repeats = repeats
        self.ids: list[str] = [i for s in shards for i in s.record["ids"]]
        self._index: dict[str, int] | None = None
        self._maps: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True, allow_incomplete: bool = False) -> GradientStore:
        root = Path(path)
        manifest = read_manifest(root)
        manifest_path = root / MANIFEST
        try:
            spec = GradientSpec.from_dict(manifest["spec"])
            int(manifest.get("world_size", 1))
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError(f"{manifest_path} is corrupted: no valid spec ({err!r})") from None
        if spec.dtype not in DTYPES:
            raise StoreError(f"{manifest_path} names an unknown storage dtype {spec.dtype!r}")
        shards, ranks, repeats = scan_shards(root, manifest, verify=verify)
        unfinished = {r: s.get("status") for r, s in ranks.items() if s.get("status") != "complete"}
        if unfinished and not allow_incomplete:
            detail = ", ".join(f"rank {r}: {s}{cls._writer_state(root, r)}" for r, s in unfinished.items())
            raise StoreError(
                f"{root} is incomplete ({detail}): its writer did not finish. {sum(s.rows for s in shards)} "
                "committed rows are readable with GradientStore.open(..., allow_incomplete=True); resume the run "
                "to complete it")
        return cls(root, manifest, shards, ranks, repeats)

    @staticmethod
    def _writer_state(root: Path, rank: int) -> str:
        holder = read_lock(root, rank)
        if not holder:
            return ""
        state = "gone" if lock_is_stale(holder) else "still holds the lock"
        return f", writer pid {holder.get('pid')} on {holder.get('host')} {state}"

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
        """The shard's raw ``[rows, dim]`` data and (int8) ``[rows]`` scales, memory-mapped copy-on-write: the
        mapping is never written (reads decode into fresh or caller-given tensors), ``"c"`` only lets torch view
        it without a copy."""
        if shard.name not in self._maps:
            np_dtype = DTYPES[self.spec.dtype][0]
            if shard.rows * self.spec.dim == 0:  # an empty file cannot be memory-mapped
                empty = np.zeros((shard.rows, self.spec.dim), dtype=np_dtype)
                self._maps[shard.name] = (empty, np.zeros(shard.rows, dtype=np.float32))
                return self._maps[shard.name]
            data = np.memmap(self.root / "shards" / shard.record["files"]["data"]["name"], dtype=np_dtype,
                             mode="c", shape=(shard.rows, self.spec.dim))
            scale = None
            if self.spec.dtype == "int8":
                scale = np.memmap(self.root / "shards" / shard.record["files"]["scale"]["name"], dtype=np.float32,
                                  mode="c", shape=(shard.rows,))
            self._maps[shard.name] = (data, scale)
        return self._maps[shard.name]

    def _convert(self, raw: np.ndarray, row_scale: np.ndarray | None, out: Tensor, scales: Tensor | None) -> None:
        """Stored values ``raw`` (and int8 scales) into ``out`` (float32 ``[n, dim]``, contiguous) in one pass, int8
        rows then scaled in place (``float32(raw) * scale``, as a fresh decode); with ``scales`` (float32 ``[n]``)
        rows stay unscaled and their scales (or 1s) are written there."""
        values = torch.from_numpy(raw)
        out.copy_(values.view(torch.bfloat16) if self.spec.dtype == "bfloat16" else values)
        if scales is not None:
            scales.copy_(torch.from_numpy(row_scale)) if row_scale is not None else scales.fill_(1.0)
        elif row_scale is not None:
            out.mul_(torch.from_numpy(row_scale).unsqueeze(1))

    def _output(self, rows: int, out: Tensor | None, scales: Tensor | None = None) -> Tensor:
        """``out`` checked to take ``rows`` decoded rows, or a fresh float32 ``[rows, dim]`` tensor (and ``scales``
        checked to take their scales)."""
        for name, given, shape in (("out", out, (rows, self.dim)), ("scales", scales, (rows,))):
            if given is not None and (given.dtype != torch.float32 or given.device.type != "cpu"
                                      or tuple(given.shape) != shape or not given.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {shape} for {rows} rows of "
                                 f"store {self.root}, got {given.dtype} {tuple(given.shape)} on "
                                 f"{given.device}{'' if given.is_contiguous() else ' (not contiguous)'}")
        return torch.empty(rows, self.dim, dtype=torch.float32) if out is None else out

    def read(self, start: int, stop: int, device: torch.device | str | None = None, *,
             out: Tensor | None = None, scales: Tensor | None = None) -> Tensor:
        """Rows ``start:stop`` as a float32 ``[n, dim]`` tensor.

        ``out``: a contiguous float32 CPU ``[n, dim]`` tensor (``n`` rows after clipping to the store) to decode
        into instead of a fresh tensor, e.g. one buffer reused for every block of a scan; it is returned (moved
        to ``device`` when one is given). ``scales``: a float32 ``[n]`` tensor that receives the rows' int8
        scales (1 for other dtypes), the returned rows then being unscaled: ``rows * scales[:, None]`` is the
        normal read, and ``(q @ rows.T) * scales`` scores without a pass over the rows to scale them.
        """
        start, stop = max(0, start), min(len(self), stop)
        out = self._output(max(0, stop - start), out, scales)
        for shard in self.shards:
            lo, hi = max(start, shard.start), min(stop, shard.start + shard.rows)
            if lo < hi:  # a slice of the mapping: a view, converted without an intermediate copy
                (data, scale), part = self._arrays(shard), slice(lo - shard.start, hi - shard.start)
                self._convert(data[part], None if scale is None else scale[part], out[lo - start:hi - start],
                              None if scales is None else scales[lo - start:hi - start])
        return out.to(device) if device is not None else out

    def rows(self, index: Sequence[int], device: torch.device | str | None = None, *,
             out: Tensor | None = None, scales: Tensor | None = None) -> Tensor:
        """The rows at ``index`` (any order, repeats allowed) as float32 ``[len(index), dim]`` (``out``, ``scales``:
        as in :meth:`read`).

        Rows are gathered in sorted order (forwards through each shard's mapping, a run of consecutive rows as one
        slice) into one array of the stored dtype, put in ``index``'s order there, and converted in one pass.
        """
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            bad = int(rows[(rows < 0) | (rows >= len(self))][0])
            raise IndexError(f"row {bad} is out of range for store {self.root} with {len(self)} rows")
        out = self._output(len(rows), out, scales)
        order = None if bool(np.all(rows[1:] >= rows[:-1])) else np.argsort(rows, kind="stable")
        sorted_rows = rows if order is None else rows[order]
        raw = np.empty((len(rows), self.dim), dtype=DTYPES[self.spec.dtype][0])
        raw_scale = np.empty(len(rows), dtype=np.float32) if self.spec.dtype == "int8" else None
        starts = np.array([s.start for s in self.shards] + [len(self)], dtype=np.int64)
        bounds = np.searchsorted(sorted_rows, starts, side="left")  # sorted_rows[bounds[k]:bounds[k + 1]]: shard k
        for k in np.nonzero(bounds[1:] > bounds[:-1])[0]:
            shard, lo, hi = self.shards[int(k)], int(bounds[k]), int(bounds[k + 1])
            local = sorted_rows[lo:hi] - shard.start
            data, scale = self._arrays(shard)
            for source, target in ((data, raw), (scale, raw_scale)) if raw_scale is not None else ((data, raw),):
                if bool(np.all(np.diff(local) == 1)):  # consecutive rows, no repeats: one slice
                    target[lo:hi] = source[int(local[0]):int(local[-1]) + 1]
                else:
                    np.take(source, local, axis=0, out=target[lo:hi], mode="clip")  # clip: unbuffered, checked above
        if order is not None:  # the caller's order, moved in the stored dtype (int8: a quarter of the float bytes)
            inverse = np.argsort(order)
            raw, raw_scale = raw[inverse], None if raw_scale is None else raw_scale[inverse]
        self._convert(raw, raw_scale, out, scales)
        return out.to(device) if device is not None else out

    def iter_blocks(self, block_rows: int = 8192, device: torch.device | str | None = None, *,
                    reuse: bool = False, prefetch: bool | None = None) -> Iterator[tuple[int, Tensor]]:
        """``(first row, [n, dim] float32)`` blocks of at most ``block_rows`` rows, in row order.

        ``reuse=True`` decodes every block into one buffer (no fresh allocation per block): a block is then only
        valid until the next one is read; keep a copy of anything needed later. ``prefetch``: decode the next block
        on a thread (:func:`gradtrace.store.prefetch.read_ahead`: pinned buffers and non-blocking copies to a CUDA
        ``device``, fresh device tensors per block); None: for a CUDA ``device`` and more than one block. On the
        CPU a prefetched block is valid until the next one is read, as with ``reuse``.
        """
        if prefetch is None:
            prefetch = device is not None and torch.device(device).type == "cuda"
        if prefetch and len(self) > block_rows:
            from .prefetch import read_ahead

            yield from read_ahead(self, block_rows, device)
            return
        buffer = torch.empty(min(block_rows, len(self)), self.dim) if reuse else None
        for start in range(0, len(self), block_rows):
            n = min(block_rows, len(self) - start)
            if buffer is None:
                yield start, self.read(start, start + n, device)
            else:
                yield start, self.read(start, start + n, device, out=buffer[:n])

    def info(self) -> dict[str, Any]:
        """A summary for ``gradtrace inspect``."""
        return {"path": str(self.root), "rows": len(self), "dim": self.dim, "dtype": self.spec.dtype,
                "params": len(self.spec.params), "projection": self.spec.projection,
                "convention": self.spec.convention, "model": self.spec.model, "shards": len(self.shards),
                "ranks": {r: s.get("status") for r, s in self.ranks.items()},
                "bytes": sum(sum(f["bytes"] for f in s.record["files"].values()) for s in self.shards),
                "created": self.manifest.get("created"), "config": self.manifest.get("config", {}),
                "environment": self.manifest.get("environment"),
                "schema_version": self.manifest.get("schema_version"), "repeated_ids": self.repeats}

    def __repr__(self) -> str:
        return (f"GradientStore({str(self.root)!r}, rows={len(self)}, dim={self.dim}, dtype={self.spec.dtype}, "
                f"shards={len(self.shards)}, complete={self.complete})")
