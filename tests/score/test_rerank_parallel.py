"""Chunk-parallel exact re-scoring (issue #14): ``rerank_exact`` runs its chunks of queries on W = torch's thread
count one-thread workers. The result is bit-identical for W = 1, 2, 3 (values and rows, top and bottom, int8 and
float32, with and without shared norm rows), equals exact streaming's scores at the kept rows within the float32
bound, leaves the caller's thread count alone, and raises the sequential path's errors unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

import gradtrace
from gradtrace.score import engine
from gradtrace.score.shortlist import rerank_exact, score_norm_rows
from gradtrace.store import GradientSpec
from tests.store.test_decode import float32_bound

DIM = 96
ROWS = 300
QUERIES = 20
R = 40  # candidates per query
CHUNK_ROWS = 100  # -> chunks of 2 queries: 10 chunks
SPEC = GradientSpec([("synthetic.weight", DIM)], None, {"reduction": "sum", "example_loss": "sum"})


@pytest.fixture(scope="module", params=["int8", "float32"])
def store(request, tmp_path_factory):
    """300 rows with norms spread over two decades, in 5 shards (the last ragged)."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(ROWS, DIM, generator=gen) * torch.logspace(-1, 1, ROWS).unsqueeze(1)
    return gradtrace.GradientSet(rows, [f"t{i}" for i in range(ROWS)], SPEC).save(
        tmp_path_factory.mktemp(f"rerank-{request.param}") / "store", dtype=request.param, shard_rows=64)


@pytest.fixture(scope="module")
def inputs(store):
    """Prepared queries, ``[Q, R]`` candidates (distinct rows per query; two queries with -1 padding) and the exact
    streaming scores of every (query, row)."""
    gen = torch.Generator().manual_seed(12)
    queries = torch.randn(QUERIES, DIM, generator=gen)
    candidates = torch.stack([torch.randperm(ROWS, generator=gen)[:R] for _ in range(QUERIES)])
    candidates[3, 30:] = -1
    candidates[16, 25:] = -1
    attr = gradtrace.Attributor("grad_dot", store, block_rows=64)
    query_set = gradtrace.GradientSet(queries, [f"q{i}" for i in range(QUERIES)], SPEC)
    exact = attr.score(query_set, topk=None, matrix=True).matrix
    return attr, attr.method.prepare_queries(queries), candidates, exact


def _with_threads(threads: int, call):
    """``call()`` with torch at ``threads`` intra-op threads (so ``rerank_exact`` uses that many workers); the
    caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("sub_rows", [7, None])
@pytest.mark.parametrize("largest", [True, False])
def test_every_worker_count_gives_the_same_bits(store, inputs, largest, sub_rows, shared, monkeypatch):
    """W = 1, 2, 3: torch.equal values and rows (sub-blocks of 7 rows or of SUB_BLOCK_BYTES; norm rows shared or
    not); the kept values are exact streaming's scores at those rows within twice the float32 bound (each side is
    within one bound of the float64 score)."""
    attr, prepared, candidates, exact = inputs
    if sub_rows is not None:
        monkeypatch.setattr(engine, "SUB_BLOCK_BYTES", sub_rows * 4 * DIM)
    side = "top" if largest else "bottom"
    common = None
    if shared:
        norms = store.read(0, ROWS).norm(dim=1)
        rows = score_norm_rows(attr, store, prepared, norms, 30, 5)
        common = (rows.member, *rows.extremes[side])
    results = [_with_threads(w, lambda: rerank_exact(attr, store, prepared, candidates, 5, largest=largest,
                                                     chunk_rows=CHUNK_ROWS, shared=common)) for w in (1, 2, 3)]
    for values, rows in results[1:]:
        assert torch.equal(values, results[0][0])
        assert torch.equal(rows, results[0][1])
    values, rows = results[0]
    assert values.shape == rows.shape == (QUERIES, 5)
    bound = float32_bound(prepared, store.read(0, ROWS))
    assert bool(((values.double() - exact.gather(1, rows).double()).abs() <= 2 * bound.gather(1, rows)).all())
    for q in range(QUERIES):  # each query keeps rows of its own candidates (or shared rows) only
        allowed = set(candidates[q][candidates[q] >= 0].tolist())
        if shared:
            allowed |= set(common[2][q].tolist())
        assert set(rows[q].tolist()) <= allowed


def test_the_workers_run_one_thread_each_and_the_callers_count_is_unchanged(store, inputs, monkeypatch):
    """With 2 threads every chunk's rows are read in a worker thread running torch with 1 thread; the calling
    thread still has 2 after the call."""
    attr, prepared, candidates, _ = inputs
    seen = []
    original = store.rows

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original(*args, **kwargs)

    monkeypatch.setattr(store, "rows", spy)
    after = _with_threads(2, lambda: (rerank_exact(attr, store, prepared, candidates, 5, chunk_rows=CHUNK_ROWS),
                                      torch.get_num_threads())[1])
    assert after == 2
    assert len(seen) >= QUERIES // 2
    assert all(name.startswith("gradtrace-chunk") and threads == 1 for name, threads in seen)


def test_a_query_with_fewer_than_k_candidates_is_refused_before_any_work(store, inputs, monkeypatch):
    attr, prepared, candidates, _ = inputs
    monkeypatch.setattr(store, "rows", lambda *a, **kw: pytest.fail("rows read before the check"))
    short = candidates.clone()
    short[7, 3:] = -1
    for workers in (1, 2):
        with pytest.raises(ValueError, match=r"the index returned 3 candidates for query 7, fewer than k=5"):
            _with_threads(workers, lambda: rerank_exact(attr, store, prepared, short, 5, chunk_rows=CHUNK_ROWS))


def test_an_error_in_a_worker_is_raised_unchanged(store, inputs):
    """A candidate past the store's end (in the 4th chunk) raises the store's IndexError, the same with 2 workers as
    sequentially."""
    attr, prepared, candidates, _ = inputs
    bad = candidates.clone()
    bad[7, 2] = ROWS + 5
    messages = []
    for workers in (1, 2):
        with pytest.raises(IndexError, match=rf"row {ROWS + 5} is out of range for store") as caught:
            _with_threads(workers, lambda: rerank_exact(attr, store, prepared, bad, 5, chunk_rows=CHUNK_ROWS))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("sub_rows", [7, None])
def test_the_norm_rows_product_is_the_same_for_every_worker_count(store, inputs, sub_rows, monkeypatch):
    """score_norm_rows in chunks of 16 rows on W = 1, 2, 3 workers: torch.equal extremes (top and bottom), each value
    exact streaming's score at its row within twice the float32 bound."""
    attr, prepared, _, exact = inputs
    if sub_rows is not None:
        monkeypatch.setattr(engine, "SUB_BLOCK_BYTES", sub_rows * 4 * DIM)
    norms = store.read(0, ROWS).norm(dim=1)
    results = [_with_threads(w, lambda: score_norm_rows(attr, store, prepared, norms, 90, 5, chunk_rows=16))
               for w in (1, 2, 3)]
    bound = float32_bound(prepared, store.read(0, ROWS))
    for side in ("top", "bottom"):
        values, rows = results[0].extremes[side]
        for other in results[1:]:
            assert torch.equal(other.extremes[side][0], values) and torch.equal(other.extremes[side][1], rows)
        assert bool(((values.double() - exact.gather(1, rows).double()).abs() <= 2 * bound.gather(1, rows)).all())
        assert set(rows.flatten().tolist()) <= set(norms.topk(90).indices.tolist())
    assert torch.equal(results[0].member, results[1].member) and int(results[0].member.sum()) == 90
