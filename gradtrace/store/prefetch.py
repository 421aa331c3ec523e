"""Reading store blocks ahead: the next block is decoded on a thread while the current one is scored.

:class:`BlockPrefetcher` takes the list of block reads a scan will make (``(store, start, stop, unscaled)``, in
order) and runs them one ahead on a background thread, each into one of two host buffers (pinned when the
target device is CUDA). For a CUDA target the thread also issues the host -> device copy from the pinned buffer
with ``non_blocking=True`` on a side stream and records an event; the consumer's stream waits on that event (no
host sync), and the thread synchronises on it only before it decodes into the same buffer again. On the CPU the
decoded block is handed over as it is (no copy) and its buffer is decoded into again once the consumer asked for
the block after it.

The blocks are the bytes :meth:`GradientStore.read` decodes (the same function, into the same float32 layout), so
scores computed from prefetched blocks are bit-identical to scores computed from blocks read in place. An error in
the thread (a damaged or vanished shard) is raised by the consumer's next :meth:`~BlockPrefetcher.next`, the
same exception object as a direct read would raise; :meth:`~BlockPrefetcher.close` stops the thread early.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Block", "BlockPrefetcher", "BlockRead", "prefetcher", "read_ahead"]

_POLL_S = 0.05  # how often a blocked thread looks whether the consumer closed the prefetcher


@dataclass(frozen=True)
class BlockRead:
    """One block to read: rows ``start:stop`` of ``store``; ``unscaled``: int8 rows left unscaled with their
    scales returned apart (as :meth:`GradientStore.read` with ``scales=``)."""

    store: Any
    start: int
    stop: int
    unscaled: bool = False


@dataclass(frozen=True)
class Block:
    """A decoded block: float32 ``rows`` ``[n, dim]`` on the target device and ``scales`` ``[n]`` (host float32; for
    an unscaled read, else None). Valid until the next block is asked for."""

    rows: Tensor
    scales: Tensor | None

    def take(self, lo: int, hi: int, scales: Tensor | None) -> Tensor:
        """Rows ``lo:hi`` (their scales copied into ``scales`` when given), as a read of them in place gives them."""
        if scales is not None:
            assert self.scales is not None
            scales.copy_(self.scales[lo:hi])
        return self.rows[lo:hi]


class _Stop(Exception):
    """The consumer closed the prefetcher: the thread leaves."""


class BlockPrefetcher:
    """Reads ``reads`` in order, one block ahead, on a thread (see the module docstring).

    reads: the blocks, in the order :meth:`next` will be called (the largest sizes the host buffers, ``depth`` of
    them). dim: the rows' width. device: where the blocks are used (CUDA: pinned buffers and non-blocking
    copies). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, reads: Sequence[BlockRead], *, dim: int, device: torch.device | str | None = None,
                 depth: int = 2) -> None:
        self.reads = list(reads)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        rows = max([r.stop - r.start for r in self.reads] + [0])
        pin = self._cuda and torch.cuda.is_available()
        self._rows = [torch.empty(rows, dim, dtype=torch.float32, pin_memory=pin) for _ in range(depth)]
        self._scales = [torch.empty(rows, dtype=torch.float32, pin_memory=pin) for _ in range(depth)]
        self._events: list[Any] = [None] * depth  # CUDA: the last copy out of each buffer
        self._free: queue.Queue = queue.Queue()
        for index in range(depth):
            self._free.put(index)
        # CUDA: at most one block waits copied on the device (device memory: about three blocks in all)
        self._ready: queue.Queue = queue.Queue(maxsize=1 if self._cuda else 0)
        self._held: int | None = None  # the CPU buffer the consumer holds
        self._taken = 0
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._thread = threading.Thread(target=self._run, name="gradtrace-prefetch", daemon=True)
        self._thread.start()

    # -- the consumer's side -------------------------------------------------------------------------
    def next(self) -> Block:
        """The next block of :attr:`reads` (the previous one is let go); raises what its read raised."""
        if self._held is not None:
            self._free.put(self._held)
            self._held = None
        if self._taken >= len(self.reads):
            raise IndexError("every block of this prefetcher was read")
        self._taken += 1
        kind, value, index, event = self._ready.get()
        if kind == "error":
            self.close()
            raise value
        if event is not None:  # CUDA: the consumer's stream waits for the copy, the host does not
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            value.rows.record_stream(stream)  # its memory is not reused before this stream's work on it
        else:
            self._held = index
        return value

    def close(self) -> None:
        """Stop the thread (blocks not read are dropped) and wait for it."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> BlockPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------------------
    def _wait(self, get: Any) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stop
            try:
                return get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def _hand(self, item: tuple) -> None:
        while True:
            if self._stop.is_set():
                raise _Stop
            try:
                self._ready.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            for read in self.reads:
                index = self._wait(self._free.get)
                if self._events[index] is not None:  # CUDA: the buffer's last copy to the device is done
                    self._events[index].synchronize()
                count = read.stop - read.start
                rows, scales = self._rows[index][:count], self._scales[index][:count]
                read.store.read(read.start, read.stop, out=rows, scales=scales if read.unscaled else None)
                scales = scales if read.unscaled else None
                if not self._cuda:
                    self._hand(("block", Block(rows, scales), index, None))
                    continue
                with torch.cuda.stream(self._stream):
                    on_device = rows.to(self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self._events[index] = event
                self._free.put(index)  # decoded into again after its event (above)
                # the scales stay on the host (a copy of them, the buffer being reused): n floats
                self._hand(("block", Block(on_device, None if scales is None else scales.clone()), index, event))
        except _Stop:
            return
        except BaseException as err:  # raised by the consumer's next()
            try:
                self._hand(("error", err, None, None))
            except _Stop:
                return


def prefetcher(prefetch: bool | None, stores: Sequence[Any], blocks: range, num_train: int, block_rows: int,
               folds_scales: bool, device: torch.device) -> BlockPrefetcher | None:
    """The prefetcher of a scoring scan over ``blocks`` of ``num_train`` rows, reading every store of ``stores``
    (None for a source that is not a store) block by block, checkpoint by checkpoint: the order of the scan; int8
    rows unscaled when the method ``folds_scales``. None when nothing is read ahead: ``prefetch`` False, or None
    (auto) on the CPU with one torch thread (decoding in place, sub-block by sub-block, keeps the rows in cache:
    faster there, ``bench/d2h.py``), a scan of one block (nothing to overlap), or no store."""
    if prefetch is None:
        prefetch = device.type == "cuda" or torch.get_num_threads() > 1
    if not prefetch or len(blocks) < 2:
        return None
    reads = [BlockRead(store, offset, min(num_train, offset + block_rows), store.spec.dtype == "int8" and folds_scales)
             for offset in blocks for store in stores if store is not None]
    return BlockPrefetcher(reads, dim=reads[0].store.dim, device=device) if reads else None


def read_ahead(store: Any, block_rows: int, device: torch.device | str | None = None
               ) -> Iterator[tuple[int, Tensor]]:
    """``(first row, [n, dim] float32)`` blocks of ``store`` in row order, each decoded on a thread while the one
    before is used (:meth:`GradientStore.iter_blocks` with ``prefetch``). On the CPU a block is valid until the next
    one is read; on CUDA each is a fresh device tensor. Closing the iterator early stops the thread."""
    if block_rows < 1:
        raise ValueError("block_rows must be positive")
    reads = [BlockRead(store, start, min(len(store), start + block_rows)) for start in range(0, len(store), block_rows)]
    with BlockPrefetcher(reads, dim=store.dim, device=device) as ahead:
        for read in reads:
            yield read.start, ahead.next().rows
