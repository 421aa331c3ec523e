"""The one path from a captured :class:`~gradtrace.GradientBatch` to stored rows: :class:`RowSink`.

Every consumer that keeps per-example rows -- a store written during capture, a trajectory, LESS features, an
in-memory :class:`~gradtrace.GradientSet`, the Trainer's rows -- hands each backward pass to a sink, which

1. takes the rows' :class:`~gradtrace.store.GradientSpec` from the first batch (:meth:`GradientSpec.from_batch`,
   reshaped by the transform) and refuses a later batch of another layout;
2. drops the examples the capture flagged NaN/inf, recording their ids (the capture already warned);
3. keys the rows (the transform: an example's id, or ``id@step`` for a trajectory) and keeps each key once, by
   the store's rule (:class:`~gradtrace.store.ledger.IdLedger`: a repeat is counted, another example under a
   kept key is an :class:`~gradtrace.store.IdCollision`);
4. makes the kept rows' vectors and per-row fields (the transform: the flattened gradient and its backward
   pass by default; LESS's sketched Adam update; ...) and hands them to a back end: :class:`MemoryRows` or
   :class:`ShardRows` (a :class:`~gradtrace.store.ShardWriter`), which drops rows whose vectors are not finite
   with a warning, by the same ledger rule.

Both back ends keep exactly the same rows, ids, fields and spec for the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ...grad.batch import GradientBatch
from ...store.ledger import IdLedger
from ...store.spec import GradientSpec
from ...store.writer import ShardWriter, per_row_lists
from ..callbacks import CaptureCallback

__all__ = ["MemoryRows", "RowBackend", "RowSink", "RowTransform", "ShardRows", "batch_digests"]


def batch_digests(batch: GradientBatch) -> list[str | None] | None:
    """The content digest of each example of ``batch`` (``batch.meta["digest"]``, set by the capture from the
    example's unpadded inputs), or None when the batch carries none."""
    digests = batch.meta.get("digest")
    if not isinstance(digests, list) or len(digests) != len(batch.ids):
        return None
    return digests


class RowTransform:
    """How a sink turns captured batches into rows. The default keeps each example's flattened gradient, keyed
    by its id, with its backward pass as the field ``step``; subclasses override what differs."""

    def spec(self, layout: GradientSpec) -> GradientSpec:
        """The spec of the rows made from batches of ``layout`` (the captured gradients' spec)."""
        return layout

    def keys(self, batch: GradientBatch) -> list[str]:
        """The row key of each example of ``batch`` (called once per batch, in order)."""
        return list(batch.ids)

    def vectors(self, batch: GradientBatch) -> Tensor:
        """``[E, dim]`` float32 rows of the examples of ``batch``."""
        return batch.flat()

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        """Per-row fields of the examples of ``batch`` (JSON values, one list per field): ``step``, its backward
        pass, and ``num_targets``, each example's target-token count, when the capture knows it (the terms of
        its summed loss; length-normalized self-influence divides by it)."""
        fields: dict[str, list] = {"step": [batch.step] * len(batch)}
        if batch.num_targets is not None:
            fields["num_targets"] = [int(n) for n in batch.num_targets.tolist()]
        return fields


class RowBackend(Protocol):
    """Where a sink's rows go: opened with their spec at the first batch, then the ledger calls and rows."""

    def open(self, spec: GradientSpec) -> None: ...

    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None) -> list[int]: ...

    def note_nonfinite(self, ids: Sequence[str]) -> None: ...

    def put(self, ids: list[str], vectors: Tensor, fields: dict[str, list],
            digests: Sequence[str | None] | None) -> None: ...

    def close(self, complete: bool) -> None: ...


class ShardRows:
    """Back end writing rows to a store: ``opener(spec)`` opens the :class:`ShardWriter` at the first batch."""

    def __init__(self, opener: Callable[[GradientSpec], ShardWriter]) -> None:
        self.opener = opener
        self.writer: ShardWriter | None = None

    def open(self, spec: GradientSpec) -> None:
        self.writer = self.opener(spec)

    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None) -> list[int]:
        return self._writer().select_new(ids, digests)

    def note_nonfinite(self, ids: Sequence[str]) -> None:
        self._writer().note_nonfinite(ids)

    def put(self, ids: list[str], vectors: Tensor, fields: dict[str, list],
            digests: Sequence[str | None] | None) -> None:
        self._writer().put(ids, vectors, fields, selected=True, digests=digests)

    def close(self, complete: bool) -> None:
        if self.writer is not None:
            self.writer.close(complete=complete)

    def _writer(self) -> ShardWriter:
        if self.writer is None:
            raise RuntimeError("the store is opened by the first batch")
        return self.writer


class MemoryRows:
    """Back end keeping rows in memory (for a :class:`~gradtrace.GradientSet`), by the store's ledger rule."""

    def __init__(self) -> None:
        self.ledger = IdLedger("this in-memory gradient set")
        self.spec: GradientSpec | None = None
        self.ids: list[str] = []
        self.fields: dict[str, list] = {}
        self._vectors: list[Tensor] = []

    def open(self, spec: GradientSpec) -> None:
        self.spec = spec

    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None) -> list[int]:
        return self.ledger.select_new(ids, digests)

    def note_nonfinite(self, ids: Sequence[str]) -> None:
        self.ledger.note_nonfinite(ids)

    def put(self, ids: list[str], vectors: Tensor, fields: dict[str, list],
            digests: Sequence[str | None] | None) -> None:
        vectors, fields = vectors.detach(), per_row_lists(fields)
        keep = self.ledger.finite_rows(ids, vectors, selected=True)
        if len(keep) < len(ids):
            vectors = vectors[torch.tensor(keep, dtype=torch.long, device=vectors.device)]
            ids = [ids[p] for p in keep]
            fields = {k: [v[p] for p in keep] for k, v in fields.items()}
            digests = None if digests is None else [digests[p] for p in keep]
        if digests is not None:
            fields = {**fields, "digest": list(digests)}
        for key in self.fields.keys() - fields.keys():  # a field some rows lack: None for them
            self.fields[key].extend([None] * len(ids))
        for key, values in fields.items():
            self.fields.setdefault(key, [None] * len(self.ids)).extend(values)
        self.ids += ids
        self._vectors.append(vectors.cpu())

    def close(self, complete: bool) -> None:
        """Nothing to release."""

    def vectors(self) -> Tensor:
        """``[N, dim]``: every kept row, in order."""
        if self.spec is None:
            raise ValueError("no rows: no batch reached the sink")
        return torch.cat(self._vectors) if self._vectors else torch.zeros(0, self.spec.dim)

    def kept_fields(self) -> dict[str, list]:
        """The per-row fields, without a ``digest`` field that no row has."""
        return {k: v for k, v in self.fields.items() if k != "digest" or any(d is not None for d in v)}


class RowSink(CaptureCallback):
    """Captured batches -> rows of one gradient set (see the module docstring); also a capture callback.

    Args:
        backend: :class:`MemoryRows` or :class:`ShardRows`.
        transform: how batches become rows (default :class:`RowTransform`).
        fingerprint: ``() -> model fingerprint`` recorded in the spec, called at the first batch (a
            collective under FSDP2: every rank's sink gets a batch).
        dtype: the storage dtype the spec records.
        what: the end of the message refusing a batch of another layout (``"the store runs/x was opened with"``).
    """

    def __init__(self, backend: RowBackend, *, transform: RowTransform | None = None,
                 fingerprint: Callable[[], dict[str, str]] = dict, dtype: str = "float32",
                 what: str = "the first batch") -> None:
        self.backend = backend
        self.transform = transform or RowTransform()
        self.fingerprint, self.dtype, self.what = fingerprint, dtype, what
        self.layout: GradientSpec | None = None  # the captured batches' spec
        self.spec: GradientSpec | None = None  # the rows' spec
        self.opened = False  # the back end is open (until close(); the next batch opens it again)

    def add(self, batch: GradientBatch) -> None:
        """Keep the rows of one captured batch."""
        if self.layout is None:
            self.layout = GradientSpec.from_batch(batch, model=self.fingerprint(), dtype=self.dtype)
            self.spec = self.transform.spec(self.layout)
        self.layout.check_batch(batch, self.what)
        if not self.opened:
            assert self.spec is not None
            self.backend.open(self.spec)
            self.opened = True
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            flagged = batch.nonfinite.cpu()
            self.backend.note_nonfinite([batch.ids[i] for i in flagged.nonzero().flatten().tolist()])
            batch = batch.select((~flagged).nonzero().flatten().tolist())
        if not len(batch):
            return
        keys = self.transform.keys(batch)
        digests = batch_digests(batch)
        new = self.backend.select_new(keys, digests)
        if not new:
            return
        if len(new) < len(keys):
            batch = batch.select(new)
            keys = [keys[i] for i in new]
            digests = None if digests is None else [digests[i] for i in new]
        self.backend.put(keys, self.transform.vectors(batch), self.transform.fields(batch), digests)

    def close(self, complete: bool = True) -> None:
        """Close the back end (a store's rank is marked complete, or interrupted)."""
        self.opened = False
        self.backend.close(complete)

    def on_batch(self, batch: GradientBatch, capture: Any = None) -> None:
        self.add(batch)

    def on_capture_end(self, capture: Any, error: BaseException | None) -> None:
        self.close(complete=error is None)
