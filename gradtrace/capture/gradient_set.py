"""``GradientSet``: per-example gradient vectors held in memory, with the same reading interface as a store.

The scoring engine reads training and query gradients through one small protocol -- ``ids``, ``spec``,
``len()``, ``read(start, stop)`` and ``iter_blocks(rows)`` -- implemented by :class:`GradientSet` (memory)
and :class:`gradtrace.store.GradientStore` (disk).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ..grad.batch import GradientBatch
from ..grad.ops import concat
from ..options import StoreOptions
from ..store.spec import GradientSpec
from .sink.rows import MemoryRows, RowSink

__all__ = ["GradientSet", "GradientSource", "as_source"]


class GradientSource(Protocol):
    """Anything the scoring engine can stream per-example gradient vectors from."""

    ids: list[str]
    spec: GradientSpec

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor: ...

    def iter_blocks(self, block_rows: int = 8192, device: torch.device | str | None = None
                    ) -> Iterator[tuple[int, Tensor]]: ...


@dataclass
class GradientSet:
    """Per-example gradient vectors in memory.

    vectors: ``[N, dim]`` float32; ids: one per row; spec: their :class:`GradientSpec`.
    batches: the :class:`GradientBatch` es they came from, when kept (per-token scores need them).
    fields: per-row metadata (e.g. ``step``).
    skipped: what :meth:`from_batches` left out: ``{"nonfinite": [ids], "duplicate": count}``.
    """

    vectors: Tensor
    ids: list[str]
    spec: GradientSpec
    batches: list[GradientBatch] | None = None
    fields: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.vectors.dim() != 2 or self.vectors.shape[0] != len(self.ids):
            raise ValueError(f"{len(self.ids)} ids for vectors of shape {tuple(self.vectors.shape)}")
        if self.vectors.shape[1] != self.spec.dim:
            raise ValueError(f"vectors have dim {self.vectors.shape[1]}, the spec says {self.spec.dim}")

    @classmethod
    def from_batches(cls, batches: Sequence[GradientBatch], model_fingerprint: dict[str, str] | None = None,
                     keep_batches: bool = False) -> GradientSet:
        """Flatten captured batches, as a store would hold them.

        The rows a store would keep, by the same path (:class:`gradtrace.capture.sink.RowSink` with a memory back end).
        Examples flagged NaN/inf are dropped (their ids in ``dropped`` and ``skipped["nonfinite"]``). An id
        seen before is kept once, as :class:`gradtrace.store.ShardWriter` does: a repeat of the same example
        (same content digest, e.g. a later epoch; or no digest on either side) is skipped and counted in
        ``skipped["duplicate"]``; the same id with another content digest raises
        :class:`gradtrace.store.IdCollision` naming it.
        """
        if not batches:
            raise ValueError("no gradients: the data was empty or no backward pass was captured")
        rows = MemoryRows()
        sink = RowSink(rows, fingerprint=lambda: dict(model_fingerprint or {}))
        for batch in batches:
            sink.add(batch)
        assert rows.spec is not None
        out = cls(rows.vectors(), rows.ids, rows.spec, list(batches) if keep_batches else None, rows.kept_fields())
        out.dropped = list(rows.ledger.skipped["nonfinite"])
        out.skipped = {"nonfinite": list(out.dropped), "duplicate": rows.ledger.skipped["duplicate"]}
        return out

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return self.spec.dim

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor:
        out = self.vectors[start:stop]
        return out.to(device) if device is not None else out

    def iter_blocks(self, block_rows: int = 8192, device: torch.device | str | None = None
                    ) -> Iterator[tuple[int, Tensor]]:
        for start in range(0, len(self), block_rows):
            yield start, self.read(start, start + block_rows, device)

    def index_of(self, ids: Sequence[str]) -> list[int]:
        index = {ident: row for row, ident in enumerate(self.ids)}
        try:
            return [index[str(i)] for i in ids]
        except KeyError as err:
            raise KeyError(f"id {err.args[0]!r} is not in this gradient set") from None

    def field(self, name: str) -> list[Any]:
        return self.fields.get(name, [None] * len(self))

    def token_batch(self) -> GradientBatch:
        """All kept batches joined (for per-token scores); raises when they were not kept."""
        if not self.batches:
            raise ValueError("per-token scores need the captured batches: "
                             "collect(..., options=CaptureOptions(keep_tokens=True))")
        return concat(self.batches) if len(self.batches) > 1 else self.batches[0]

    def save(self, path: str | Path, dtype: str = "float32", shard_rows: int = 4096,
             overwrite: bool = False) -> Any:
        """Write these vectors as a gradient store and return it opened."""
        from ..store import GradientStore, ShardWriter

        spec = GradientSpec(self.spec.params, self.spec.projection, self.spec.convention, self.spec.model, dtype)
        writer = ShardWriter(path, spec, StoreOptions(shard_rows=shard_rows, overwrite=overwrite), rank=0, world_size=1)
        try:
            writer.put(self.ids, self.vectors, {k: v for k, v in self.fields.items() if len(v) == len(self)})
        finally:
            writer.close()
        return GradientStore.open(path)

    def __repr__(self) -> str:
        return f"GradientSet(rows={len(self)}, dim={self.dim}, projection={self.spec.projection is not None})"


def as_source(value: Any) -> Any:
    """Accept a store path, an opened store, a :class:`GradientSet` or captured batches."""
    from ..store import GradientStore

    if isinstance(value, (str, Path)):
        return GradientStore.open(value)
    if isinstance(value, GradientBatch):
        return GradientSet.from_batches([value], keep_batches=True)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, GradientBatch) for v in value):
        return GradientSet.from_batches(list(value), keep_batches=True)
    if hasattr(value, "iter_blocks") and hasattr(value, "spec"):
        return value
    raise TypeError("expected a gradient store, a store path, a GradientSet or GradientBatches, got "
                    f"{type(value).__name__}")
