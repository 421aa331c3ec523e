"""The device -> host path of stored rows: encoded on their device, copied without blocking the backward pass.

A batch's rows are converted to the store dtype where they are (:func:`encode_rows`: int8 codes and per-row
float32 scales, or bfloat16, computed by :func:`gradtrace.grad.quantize.quantize`, the one encoder whatever the
device: IEEE division, round half to even and absmax give the same bytes on a CPU and a GPU), so that only the
stored bytes cross the bus (a quarter of the float32 rows for int8).

:func:`to_host` then moves the encoded rows off the device:

* CUDA rows are copied into one of the pinned host buffers of a :class:`PinnedPool` (two by default: double
  buffering) with ``non_blocking=True``, and a CUDA event is recorded after the copy. The writer thread receives
  the :class:`HostRows` and calls :meth:`HostRows.wait` (``event.synchronize()``) before it reads them, then
  :meth:`HostRows.release` once they are written. A buffer is handed out again only when it was released *and* its
  event has completed, so it is never overwritten while a copy into it is in flight or the writer still reads
  it. When every buffer is busy (the disk is behind), the rows take a plain synchronous copy instead: memory stays
  bounded by the writer's queue, not by the pool.
* CPU rows are encoded here, on the calling thread, with its intra-op threads. Encoding them on the writer thread
  instead (as before) ran its parallel ops (a copy, int8's absmax and rounding) in a second OpenMP team, which
  competes with the training threads for the cores: ``bench/moe_capture.py`` at 2 threads on 2 cores took 3.11 s
  per collection into a float32 store and 3.08 s into an int8 one, against 2.25 s into memory; encoded here, 2.30 s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..grad.quantize import QuantizedRows, check_scales, quantize

__all__ = ["QUANT_MODE", "HostRows", "PinnedPool", "encode_rows", "stage", "to_host"]

QUANT_MODE = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
"""Store dtype -> :func:`~gradtrace.grad.quantize.quantize` mode."""
_STORE_DTYPE = {mode: dtype for dtype, mode in QUANT_MODE.items()}

_ALIGN = 64  # byte offset of the scales inside a buffer (a float32 view needs a 4-byte aligned offset)


class Event(Protocol):
    """What the pool needs of a ``torch.cuda.Event`` (a fake one in the tests)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def encode_rows(rows: Tensor, dtype: str, *, copy: bool = True, check_finite: bool = True) -> QuantizedRows:
    """``rows`` ``[n, dim]`` (any float dtype, any device) in the store's ``dtype``, on their device.

    The rows are made float32 first (exact for bfloat16/float16 input, IEEE rounding for float64), then
    :func:`~gradtrace.grad.quantize.quantize` encodes them: the same function and the same operations on every
    device, so a CPU and a CUDA encoding of the same float32 rows are the same bytes. With ``copy`` the result
    never shares memory with ``rows`` (the caller may reuse them; float32 rows of a float32 store are copied).
    ``check_finite=False``: no host read of the int8 scales here (:meth:`HostRows.wait` checks them on the host).
    """
    if dtype not in QUANT_MODE:
        raise ValueError(f"storage dtype must be one of {sorted(QUANT_MODE)}, got {dtype!r}")
    encoded = quantize(rows.to(torch.float32), QUANT_MODE[dtype], check_finite=check_finite)
    if copy and encoded.data.data_ptr() == rows.data_ptr() and rows.numel():  # rows kept as they are: a copy
        encoded = QuantizedRows(encoded.data.clone(), encoded.scale, encoded.mode)
    return encoded


@dataclass
class _Slot:
    buffer: Tensor  # uint8 [capacity] host memory (pinned on a CUDA machine)
    event: Any = None  # the event recorded after the last copy into it (None: none yet)
    held: bool = False  # handed out and not released yet


@dataclass
class PinnedPool:
    """A few reusable host buffers for device -> host copies of encoded rows (see the module docstring).

    slots: how many buffers (2: one filled by the device while the writer reads the other).
    allocate: ``nbytes -> uint8 host tensor`` (default: pinned memory); new_event: ``() -> event`` recorded after a
    copy (default: ``torch.cuda.Event``). Both are replaced by fakes in the CPU tests. ``stats``: copies through a
    buffer (``pinned``) and copies that found every buffer busy (``fallback``). Thread-safe.
    """

    slots: int = 2
    allocate: Callable[[int], Tensor] = field(default=lambda nbytes: torch.empty(nbytes, dtype=torch.uint8,
                                                                                 pin_memory=True))
    new_event: Callable[[], Any] = field(default=lambda: torch.cuda.Event())

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("a pinned pool needs at least one buffer")
        self._slots: list[_Slot | None] = [None] * self.slots
        self._lock = threading.Lock()
        self.stats = {"pinned": 0, "fallback": 0}

    def acquire(self, nbytes: int) -> int | None:
        """Index of a buffer of at least ``nbytes`` that no copy and no reader uses (marked held), or None when every
        buffer is busy. A free buffer that is too small is replaced by a larger one."""
        with self._lock:
            for index, slot in enumerate(self._slots):
                if slot is not None and (slot.held or (slot.event is not None and not slot.event.query())):
                    continue  # handed out, or a copy into it may still be running
                if slot is None or slot.buffer.numel() < nbytes:
                    capacity = max(nbytes, 2 * (slot.buffer.numel() if slot is not None else 0), _ALIGN)
                    slot = self._slots[index] = _Slot(self.allocate(capacity))
                slot.held, slot.event = True, None
                self.stats["pinned"] += 1
                return index
            self.stats["fallback"] += 1
            return None

    def buffer(self, index: int) -> Tensor:
        slot = self._slots[index]
        assert slot is not None and slot.held
        return slot.buffer

    def recorded(self, index: int, event: Any) -> None:
        """The copy into buffer ``index`` was issued and ``event`` recorded after it."""
        slot = self._slots[index]
        assert slot is not None
        slot.event = event

    def release(self, index: int) -> None:
        """The reader is done with buffer ``index``: it is reused once its event has completed."""
        with self._lock:
            slot = self._slots[index]
            assert slot is not None
            slot.held = False

    def busy(self) -> int:
        """Buffers handed out or with a copy in flight."""
        with self._lock:
            return sum(s is not None and (s.held or (s.event is not None and not s.event.query()))
                       for s in self._slots)


@dataclass
class HostRows:
    """Encoded rows on their way to the writer thread: :meth:`wait` gives them (on the host), :meth:`release`
    after they are written hands their buffer back.

    ``encoded``: the rows in the store's dtype, on the host (or being copied there); ``event``: what :meth:`wait`
    synchronises on; ``pool``/``slot``: the buffer; ``checked``: whether int8 scales were checked finite when
    encoded (rows encoded on a device are checked by :meth:`wait`).
    """

    dtype: str
    encoded: QuantizedRows
    event: Any = None
    pool: PinnedPool | None = None
    slot: int | None = None
    checked: bool = False

    def wait(self) -> QuantizedRows:
        """The encoded rows, once the copy that fills them has completed (the writer thread's side).

        Raises ``ValueError`` when an int8 row is not finite: rows encoded on the device are checked here, on
        their host copy of the scales, so that the training thread never waits for the check."""
        if self.event is not None:
            self.event.synchronize()
        if not self.checked and self.encoded.scale is not None:
            check_scales(self.encoded.scale)
        self.checked = True
        return self.encoded

    def release(self) -> None:
        """Hand the buffer back to the pool (no-op without one, or when called twice)."""
        if self.pool is not None and self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None


def _views(buffer: Tensor, encoded: QuantizedRows) -> tuple[Tensor, Tensor | None]:
    """Views of ``buffer`` (uint8) shaped as ``encoded``'s data and scales (scales at an aligned offset)."""
    data_bytes = encoded.data.numel() * encoded.data.element_size()
    data = buffer[:data_bytes].view(encoded.data.dtype).view(encoded.data.shape)
    if encoded.scale is None:
        return data, None
    start = -(-data_bytes // _ALIGN) * _ALIGN
    scale = buffer[start:start + 4 * encoded.scale.numel()].view(torch.float32)
    return data, scale


def _nbytes(encoded: QuantizedRows) -> int:
    data_bytes = -(-encoded.data.numel() * encoded.data.element_size() // _ALIGN) * _ALIGN
    return data_bytes + (4 * encoded.scale.numel() if encoded.scale is not None else 0)


def to_host(rows: Tensor, dtype: str, pool: PinnedPool | None, *, copy: bool = True) -> HostRows:
    """Rows ``[n, dim]`` (float, on any device) on their way to the host in ``dtype``.

    CUDA rows (with a ``pool``): encoded on the device, copied into a pinned buffer with ``non_blocking=True``
    and an event recorded on the current stream (a plain copy when every buffer is busy); work the caller queues
    later on that stream (reusing ``rows``) runs after the copy. Other rows: encoded on the host now, on the
    calling thread (see the module docstring); with ``copy`` they never alias ``rows`` (pass False for rows the
    caller lets go).
    """
    if not rows.is_cuda or pool is None:
        host = rows.to("cpu")
        encoded = encode_rows(host, dtype, copy=copy and host.data_ptr() == rows.data_ptr())  # scales checked
        return HostRows(dtype, encoded, checked=True)
    # encoded on the device, only the stored bytes move; the scales are checked on the host (HostRows.wait)
    return stage(encode_rows(rows, dtype, copy=False, check_finite=False), pool)


def stage(encoded: QuantizedRows, pool: PinnedPool) -> HostRows:
    """Encoded rows copied into one of ``pool``'s buffers (``non_blocking``; an event from ``pool.new_event``
    recorded after the copy), or copied synchronously to pageable memory when every buffer is busy."""
    dtype = _STORE_DTYPE[encoded.mode]
    slot = pool.acquire(_nbytes(encoded))
    if slot is None:  # every buffer busy: a synchronous copy, the queue still bounds memory
        return HostRows(dtype, encoded=QuantizedRows(encoded.data.cpu(), None if encoded.scale is None
                                                     else encoded.scale.cpu(), encoded.mode))
    data, scale = _views(pool.buffer(slot), encoded)
    data.copy_(encoded.data, non_blocking=True)
    if scale is not None:
        scale.copy_(encoded.scale, non_blocking=True)
    event = pool.new_event()
    event.record()
    pool.recorded(slot, event)
    # the device tensors may be freed now: the caching allocator hands their memory only to work queued after
    # the copy on this stream
    return HostRows(dtype, encoded=QuantizedRows(data, scale, encoded.mode), event=event, pool=pool, slot=slot)
