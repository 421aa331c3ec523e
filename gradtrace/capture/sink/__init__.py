"""Sinks: where captured per-example gradients go (a store, memory), by one path (:class:`RowSink`).

The layer between the capture (hooks, :class:`~gradtrace.GradientBatch`) and the store (pure I/O): a sink
builds the rows' spec, drops non-finite examples, keys and de-duplicates rows, applies a transform and hands
the rows to a back end. :class:`StoreWriter` is the capture callback that writes a store.
"""

from .rows import MemoryRows, RowBackend, RowSink, RowTransform, ShardRows, batch_digests
from .store_writer import ExtraFields, StoreWriter

__all__ = ["ExtraFields", "MemoryRows", "RowBackend", "RowSink", "RowTransform", "ShardRows", "StoreWriter",
           "batch_digests"]
