"""Scoring with store blocks read ahead (:mod:`gradtrace.store.prefetch`): bit-identical scores with and without
prefetch (int8 with folded and unfolded scales, bfloat16, float32, several checkpoints, one or two intra-op
threads), an error in the reading thread raised as the read in place raises it, and no thread left behind."""

from __future__ import annotations

import threading

import pytest
import torch

import gradtrace
from gradtrace.store import GradientStore
from gradtrace.store.prefetch import BlockPrefetcher, BlockRead
from tests.store.common import make_spec

ROWS, DIM = 700, 48


def _store(root, dtype: str, seed: int) -> GradientStore:
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.randn(ROWS, DIM, generator=gen) * torch.logspace(-2, 2, ROWS).unsqueeze(1)
    vectors[5] = 0.0
    spec = make_spec(dtype, params=[("w", DIM)])
    return gradtrace.GradientSet(vectors, [f"t{i}" for i in range(ROWS)], spec).save(root, dtype=dtype, shard_rows=96)


def _queries(seed: int = 9) -> gradtrace.GradientSet:
    gen = torch.Generator().manual_seed(seed)
    return gradtrace.GradientSet(torch.randn(5, DIM, generator=gen), [f"q{i}" for i in range(5)],
                                 make_spec(params=[("w", DIM)]))


def _score(method: str, train, queries, prefetch: bool, **options):
    attributor = gradtrace.Attributor(method, train, block_rows=128, **options)
    attributor.prefetch = prefetch
    return attributor.score(queries, topk=7, matrix=True)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gradtrace-prefetch"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "method"), [("int8", "grad_dot"), ("int8", "grad_cos"), ("bfloat16", "grad_dot"),
                                               ("float32", "grad_cos")])
def test_scores_are_bit_identical_with_and_without_prefetch(tmp_path, monkeypatch, dtype, method, threads):
    store = _store(tmp_path / "s", dtype, seed=1)
    queries = _queries()
    taken = []
    real_next = BlockPrefetcher.next
    monkeypatch.setattr(BlockPrefetcher, "next", lambda self: taken.append(1) or real_next(self))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # one thread: rows_product's sub-blocks, two: whole blocks
    try:
        plain = _score(method, store, queries, prefetch=False)
        assert not taken
        ahead = _score(method, store, queries, prefetch=True)
        assert len(taken) == 6  # every block was read ahead
    finally:
        torch.set_num_threads(before)
    assert torch.equal(plain.matrix, ahead.matrix)
    assert torch.equal(plain.top[0], ahead.top[0]) and torch.equal(plain.top[1], ahead.top[1])
    assert torch.equal(plain.bottom[1], ahead.bottom[1])
    assert not _prefetch_threads()


def test_checkpoints_are_read_ahead_in_scan_order(tmp_path):
    stores = [_store(tmp_path / f"c{c}", "int8", seed=c) for c in range(2)]
    queries = [_queries(5), _queries(6)]
    plain = _score("tracin", stores, queries, prefetch=False, weights=[0.5, 2.0])
    ahead = _score("tracin", stores, queries, prefetch=True, weights=[0.5, 2.0])
    assert torch.equal(plain.matrix, ahead.matrix)


def _damage(store: GradientStore) -> None:
    """Cut the data file of the store's fourth shard short, after the store was opened (the mapping fails)."""
    shard = store.shards[3]
    path = store.root / "shards" / shard.record["files"]["data"]["name"]
    path.write_bytes(path.read_bytes()[:10])


def test_an_error_in_the_reading_thread_is_the_error_of_a_read_in_place(tmp_path):
    queries = _queries()
    errors = []
    for prefetch in (False, True):
        store = _store(tmp_path / f"s{prefetch}", "int8", seed=1)
        _damage(store)
        with pytest.raises(Exception) as caught:  # the point: both are the same
            _score("grad_dot", store, queries, prefetch=prefetch)
        errors.append(caught.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert not _prefetch_threads()


def test_a_scan_that_stops_early_stops_the_thread(tmp_path):
    store = _store(tmp_path / "s", "float32", seed=1)
    reads = [BlockRead(store, start, min(ROWS, start + 100)) for start in range(0, ROWS, 100)]
    with BlockPrefetcher(reads, dim=DIM) as ahead:
        first = ahead.next()
        assert torch.equal(first.rows, store.read(0, 100)) and first.scales is None
    assert not _prefetch_threads()
    with BlockPrefetcher(reads, dim=DIM) as ahead:
        for read in reads:
            block = ahead.next()
            assert torch.equal(block.rows, store.read(read.start, read.stop))
        with pytest.raises(IndexError):
            ahead.next()


def test_unscaled_int8_blocks_come_with_their_scales(tmp_path):
    store = _store(tmp_path / "s", "int8", seed=2)
    reads = [BlockRead(store, 0, 300, unscaled=True), BlockRead(store, 300, ROWS, unscaled=True)]
    with BlockPrefetcher(reads, dim=DIM) as ahead:
        for read in reads:
            block = ahead.next()
            scales = torch.empty(read.stop - read.start)
            raw = store.read(read.start, read.stop, scales=scales)
            assert torch.equal(block.rows, raw) and torch.equal(block.scales, scales)


def test_iter_blocks_with_prefetch_gives_the_blocks_of_a_read_in_place(tmp_path):
    store = _store(tmp_path / "s", "int8", seed=4)
    plain = [(start, block.clone()) for start, block in store.iter_blocks(128)]
    ahead = [(start, block.clone()) for start, block in store.iter_blocks(128, prefetch=True)]
    assert [s for s, _ in plain] == [s for s, _ in ahead] == list(range(0, ROWS, 128))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, ahead))
    blocks = store.iter_blocks(128, prefetch=True)
    next(blocks)
    assert _prefetch_threads()
    blocks.close()  # a scan that stops early
    assert not _prefetch_threads()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocks_are_copied_from_pinned_buffers(tmp_path):
    store = _store(tmp_path / "s", "int8", seed=3)
    queries = _queries()
    plain = gradtrace.Attributor("grad_dot", store, block_rows=128).score(queries, topk=7, matrix=True)
    ahead = _score("grad_dot", store, queries, prefetch=True, device="cuda")
    torch.testing.assert_close(ahead.matrix, plain.matrix, rtol=1e-5, atol=1e-5)
    for (start, block), (same, want) in zip(store.iter_blocks(128, "cuda"), store.iter_blocks(128)):
        assert start == same and block.is_cuda and torch.equal(block.cpu(), want)
