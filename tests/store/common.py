"""Helpers shared by the store tests: a small spec, deterministic rows, a writer that fills a store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from gradtrace.options import StoreOptions
from gradtrace.store import GradientSpec, ShardWriter

PARAMS = [("fc1.weight", 6), ("fc1.bias", 3), ("head.weight", 5)]
DIM = sum(d for _, d in PARAMS)
PROJECTION = {"kind": "logra", "scheme": "test", "distribution": "gaussian", "seed": 3, "rank_rows": 2,
              "rank_cols": 2, "vector_rank": 3}
CONVENTION = {"reduction": "mean", "example_loss": "sum"}
MODEL = {"class": "Tiny", "arch": "a1b2c3d4e5f60718", "weights": "0011223344556677"}


def make_spec(dtype: str = "float32", **changes) -> GradientSpec:
    fields = dict(params=list(PARAMS), projection=dict(PROJECTION), convention=dict(CONVENTION), model=dict(MODEL),
                  dtype=dtype)
    fields.update(changes)
    return GradientSpec(**fields)


def make_rows(n: int, seed: int = 0, dim: int = DIM) -> tuple[list[str], torch.Tensor]:
    """``n`` ids and ``[n, dim]`` float32 rows with a wide spread of magnitudes (per row and per entry)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=gen) * torch.logspace(-3, 2, n).unsqueeze(1)
    return [f"ex{seed}-{i}" for i in range(n)], rows


def write(path: Path, ids: list[str], rows: torch.Tensor, *, chunks: list[int] | None = None,
          dtype: str = "float32", shard_rows: int = 5, fields: dict[str, list] | None = None, **options):
    """Put ``rows`` through a ShardWriter in puts of ``chunks`` rows; returns the (closed) writer."""
    chunks = chunks or [len(ids)]
    assert sum(chunks) == len(ids)
    store = {k: options.pop(k) for k in list(options) if k in {f.name for f in dataclasses.fields(StoreOptions)}}
    writer = ShardWriter(path, make_spec(dtype), StoreOptions(shard_rows=shard_rows, **store), **options)
    start = 0
    for size in chunks:
        part = {k: v[start:start + size] for k, v in (fields or {}).items()}
        writer.put(ids[start:start + size], rows[start:start + size], part)
        start += size
    writer.close()
    return writer


def status(path: Path, rank: int = 0) -> dict:
    return json.loads((Path(path) / f"rank-{rank:05d}.json").read_text())


def reseal_record(root: Path, record: dict) -> None:
    """Rewrite shard ``record`` as a writer would commit it: its file, and its checksum in the rank file's list
    (the store then opens as if another tool had written it that way: a consistent change, not a corruption)."""
    from gradtrace.store.artifact import checksum

    raw = json.dumps(record).encode()
    (Path(root) / "shards" / f"{record['name']}.json").write_bytes(raw)
    rank_path = Path(root) / f"rank-{int(record['rank']):05d}.json"
    status = json.loads(rank_path.read_text())
    for entry in status["committed"]:
        if entry["name"] == record["name"]:
            entry["record"] = checksum(raw)
    rank_path.write_text(json.dumps(status))
