"""The device -> host path of stored rows (:mod:`gradtrace.store.transfer`), on the CPU.

* the encoding: int8 codes and scales (and bfloat16 values) are the bytes of the reference encoding written out
  here (the CPU path before rows were encoded on their device), for random rows with zero rows, signed zeros,
  subnormals, ties at ``.5``, the float32 extremes and bfloat16/float64 input; a store written through the
  writer holds exactly those bytes;
* the pinned pool: a buffer is handed out again only after it was released *and* its event completed, never
  while a copy into it is in flight; when every buffer is busy the rows take a plain copy; buffers grow;
* the staged copy (what a CUDA put does, with CPU tensors and a fake event): the writer thread synchronises on
  the event before it reads the rows, and a buffer is not overwritten while the writer holds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradtrace.grad.quantize import QuantizedRows
from gradtrace.store import GradientStore, ShardWriter
from gradtrace.store.transfer import HostRows, PinnedPool, encode_rows, stage, to_host

from .common import make_spec


def _reference_int8(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The int8 encoding as the CPU path computed it: per-row absmax / 127, round half to even, clamp."""
    values = rows.to("cpu", torch.float32)
    scale = values.abs().amax(dim=1) / 127.0
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    codes = torch.round(values / divisor).clamp(-127, 127).to(torch.int8)
    return codes.numpy().copy(), scale.numpy().copy()


def _hard_rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(64, 96, generator=gen) * torch.logspace(-30, 30, 64).unsqueeze(1)
    rows[0] = 0.0  # an all-zero row: scale 0, codes 0
    rows[1] = -0.0
    rows[2, :] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, 96)  # the float32 extremes
    rows[3, :] = torch.finfo(torch.float32).tiny / 8  # subnormals
    rows[4, :] = torch.arange(96, dtype=torch.float32) - 47.5  # ties at .5 after scaling
    rows[4, 0] = 127.0  # scale exactly 1
    rows[5, :3] = torch.tensor([1.0, -1.0, 0.5])
    rows[5, 3:] = 0.0
    return rows


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float64])
def test_int8_encoding_equals_the_reference_bytes(source):
    rows = _hard_rows().to(source) if source != torch.float64 else _hard_rows().double() * (1 + 1e-12)
    rows = rows[rows.isfinite().all(dim=1)]
    codes, scales = _reference_int8(rows)
    encoded = encode_rows(rows, "int8")
    assert encoded.data.dtype == torch.int8 and encoded.scale.dtype == torch.float32
    assert encoded.data.numpy().tobytes() == codes.tobytes()
    assert encoded.scale.numpy().tobytes() == scales.tobytes()
    # the same from a strided (non-contiguous) view of the rows
    wide = torch.zeros(rows.shape[0], rows.shape[1] * 2, dtype=rows.dtype)
    wide[:, ::2] = rows
    again = encode_rows(wide[:, ::2], "int8")
    assert again.data.numpy().tobytes() == codes.tobytes() and again.scale.numpy().tobytes() == scales.tobytes()


def test_float_encodings_equal_the_reference_bytes():
    rows = _hard_rows(1)
    half = encode_rows(rows, "bfloat16")
    assert half.data.view(torch.int16).numpy().tobytes() == rows.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    exact = encode_rows(rows, "float32")
    assert exact.data.numpy().tobytes() == rows.numpy().tobytes()
    assert exact.data.data_ptr() != rows.data_ptr()  # a copy: the caller may reuse its rows
    assert encode_rows(rows, "float32", copy=False).data.data_ptr() == rows.data_ptr()
    with pytest.raises(ValueError, match="storage dtype"):
        encode_rows(rows, "int4")


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float32"])
def test_store_bytes_equal_the_reference(tmp_path, dtype):
    rows = _hard_rows(2)
    rows = rows[rows.isfinite().all(dim=1)]
    spec = make_spec(dtype, params=[("w", rows.shape[1])])
    ids = [f"r{i}" for i in range(len(rows))]
    given = rows.clone()
    with ShardWriter(tmp_path / "s", spec) as writer:
        writer.put(ids[:20], given[:20])
        writer.put(ids[20:], given[20:])
        given.fill_(7.0)  # the caller reuses its rows: what was put is kept
    store = GradientStore.open(tmp_path / "s")
    data = np.concatenate([store._arrays(s)[0] for s in store.shards])
    if dtype == "int8":
        codes, scales = _reference_int8(rows)
        assert data.tobytes() == codes.tobytes()
        assert np.concatenate([store._arrays(s)[1] for s in store.shards]).tobytes() == scales.tobytes()
    elif dtype == "bfloat16":
        assert data.tobytes() == rows.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    else:
        assert data.tobytes() == rows.numpy().tobytes()


class FakeEvent:
    """A CUDA event whose completion the test decides; counts synchronize() calls."""

    def __init__(self) -> None:
        self.recorded = False
        self.done = False
        self.waits = 0

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _pool(slots: int = 2) -> tuple[PinnedPool, list[FakeEvent], list[int]]:
    events: list[FakeEvent] = []
    sizes: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    return PinnedPool(slots, allocate=allocate, new_event=new_event), events, sizes


def test_pool_reuses_a_buffer_only_after_release_and_completed_event():
    pool, _, sizes = _pool()
    first, second = pool.acquire(100), pool.acquire(100)
    assert {first, second} == {0, 1} and len(sizes) == 2
    assert pool.acquire(100) is None and pool.stats == {"pinned": 2, "fallback": 1}  # both busy
    pending, finished = FakeEvent(), FakeEvent()
    pool.recorded(first, pending)
    pool.recorded(second, finished)
    pool.release(first)  # released, but its copy is still in flight (e.g. a writer that died and dropped it)
    assert pool.acquire(100) is None
    pool.release(second)
    assert pool.acquire(100) is None  # its event has not completed either
    finished.done = True
    assert pool.acquire(100) == second
    pending.done = True
    assert pool.acquire(100) == first
    assert pool.busy() == 2 and len(sizes) == 2  # reused, not reallocated


def test_pool_grows_a_buffer_that_is_too_small():
    pool, _, sizes = _pool(slots=1)
    slot = pool.acquire(100)
    pool.release(slot)
    assert pool.acquire(1000) == slot and pool.buffer(slot).numel() >= 1000 and len(sizes) == 2
    with pytest.raises(ValueError):
        PinnedPool(0)


def test_staged_copy_waits_on_its_event_and_is_never_overwritten_while_held():
    pool, events, _ = _pool()
    batches = [torch.randn(8, 32) * (i + 1) for i in range(3)]
    staged: list[HostRows] = []
    for rows in batches[:2]:
        staged.append(stage(encode_rows(rows, "int8"), pool))
    assert all(e.recorded for e in events) and [h.slot for h in staged] == [0, 1]
    # a third batch while both buffers are held by the writer: a plain copy, the held ones untouched
    third = stage(encode_rows(batches[2], "int8"), pool)
    assert third.slot is None and third.event is None and pool.stats["fallback"] == 1
    for host, rows in zip(staged, batches):
        got = host.wait()
        assert host.event.waits == 1  # the writer synchronised before reading
        want = encode_rows(rows, "int8")
        assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
        host.release()
        host.release()  # twice: no-op
    # released and completed: the next batch reuses a buffer, the old HostRows' views now see the new rows
    fourth = stage(encode_rows(batches[2], "int8"), pool)
    assert fourth.slot in (0, 1)
    assert torch.equal(fourth.wait().data, encode_rows(batches[2], "int8").data)


def test_device_encoding_reads_nothing_on_the_host_and_the_writer_side_refuses_a_non_finite_row():
    """The CUDA path (encode unchecked, stage, wait) with CPU tensors: no host read while encoding; a row with nan
    or inf is refused by :meth:`HostRows.wait` (the writer thread), as the checked CPU path refuses it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("host_reads", Path(__file__).resolve().parents[2] / "bench" /
                                                  "host_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = torch.randn(6, 32)
    with module.HostReads() as reads:
        encoded = encode_rows(rows, "int8", copy=False, check_finite=False)
    assert not reads.sites, reads.sites
    with module.HostReads() as reads:
        encode_rows(rows, "int8")
    assert sum(reads.sites.values()) == 1  # the checked encoding: one read of the scales
    want = encode_rows(rows, "int8")
    assert torch.equal(encoded.data, want.data) and torch.equal(encoded.scale, want.scale)
    pool, _, _ = _pool()
    assert torch.equal(stage(encoded, pool).wait().data, want.data)
    for bad in (float("nan"), float("inf")):
        rows[3, 5] = bad
        host = stage(encode_rows(rows, "int8", copy=False, check_finite=False), pool)
        with pytest.raises(ValueError, match="needs finite rows"):
            host.wait()
        host.release()
        with pytest.raises(ValueError, match="needs finite rows"):
            encode_rows(rows, "int8")


def test_cpu_rows_take_no_pool_and_are_encoded_on_the_calling_thread():
    """Encoded where they are (a parallel op on the writer thread would start a second OpenMP team competing with
    the training threads): the encoding is the reference's, never aliases the caller's rows unless it lets them go."""
    rows = torch.randn(4, 16)
    pool, _, sizes = _pool()
    host = to_host(rows, "int8", pool)
    assert host.encoded is not None and host.event is None and not sizes
    codes, scales = _reference_int8(rows)
    rows.zero_()  # the caller reuses its rows: the encoded ones are unchanged
    got = host.wait()
    assert isinstance(got, QuantizedRows) and got.mode == "int8"
    assert got.data.numpy().tobytes() == codes.tobytes() and got.scale.numpy().tobytes() == scales.tobytes()
    fresh = torch.randn(4, 16)
    kept = to_host(fresh, "float32", pool)
    assert kept.wait().data.data_ptr() != fresh.data_ptr() and torch.equal(kept.wait().data, fresh)
    assert to_host(fresh, "float32", pool, copy=False).wait().data.data_ptr() == fresh.data_ptr()  # let go: as is
    bf16 = to_host(fresh, "bfloat16", pool).wait()
    assert bf16.data.dtype == torch.bfloat16 and torch.equal(bf16.data, fresh.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_take_a_pinned_non_blocking_copy():
    rows = _hard_rows(3).cuda()
    rows = rows[rows.isfinite().all(dim=1)]
    pool = PinnedPool()
    host = to_host(rows, "int8", pool)
    assert host.encoded is not None and host.encoded.data.is_pinned()
    got = host.wait()
    codes, scales = _reference_int8(rows.cpu())
    assert got.data.numpy().tobytes() == codes.tobytes() and got.scale.numpy().tobytes() == scales.tobytes()
    host.release()
