"""FAISS index + exact re-scoring: equal to exact streaming scoring when the shortlist covers the top-k, for
grad_dot, grad_cos and K-FAC influence; a changed store, another store, a mismatched normalization, non-finite
rows or queries and a missing FAISS are refused with one clear error."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import gradtrace
from gradtrace.fit.curvature import Curvature
from gradtrace.options import StoreOptions
from gradtrace.options.index import IndexOptions, SearchOptions
from gradtrace.score.index import FaissMissing, Index, IndexMismatch, IndexParams, build_index, store_fingerprint
from gradtrace.score.shortlist import score_with_index
from gradtrace.store import GradientStore, ShardWriter
from gradtrace.store.artifact import UncheckedArtifactWarning, artifact_file, checksum
from tests.score.legacy_index import save_v1
from tests.store.common import reseal_record

pytest.importorskip("faiss")

V1 = Path(__file__).parent.parent / "fixtures" / "v1"
ROWS = 600


def _clustered(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Rows in 12 clusters with log-normal norms: a top-k decided by norms and noise within clusters."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(12, dim, generator=gen)
    which = torch.randint(0, 12, (rows,), generator=gen)
    norms = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
    return norms * (centres[which] + 0.8 * torch.randn(rows, dim, generator=gen))


@pytest.fixture(scope="module")
def spec():
    """The layout of the checked-in v1 K-FAC curvature (so that its influence method applies to these rows)."""
    return GradientStore.open(V1 / "store", verify=False).spec


@pytest.fixture(scope="module")
def store(tmp_path_factory, spec) -> GradientStore:
    """600 float32 rows of the v1 layout in 5 shards (the last one ragged)."""
    root = tmp_path_factory.mktemp("index") / "store"
    vectors = _clustered(ROWS, spec.dim, seed=1)
    stored = gradtrace.GradientSet(vectors, [f"t{i}" for i in range(ROWS)], spec).save(root, shard_rows=128)
    return stored


@pytest.fixture(scope="module")
def queries(store, spec) -> gradtrace.GradientSet:
    gen = torch.Generator().manual_seed(2)
    rows = store.read(0, len(store))
    picks = torch.randint(0, ROWS, (6,), generator=gen)
    vectors = rows[picks] + 0.5 * rows[picks.flip(0)] + 0.3 * torch.randn(6, spec.dim, generator=gen)
    return gradtrace.GradientSet(vectors, [f"q{i}" for i in range(6)], spec)


@pytest.fixture(scope="module")
def flat(store) -> Index:
    return build_index(store, IndexOptions(kind="flat"), block_rows=100)


def _exact(method: str, store, queries, **options):
    return gradtrace.Attributor(method, store, block_rows=128, **options).score(queries, topk=10, matrix=True)


def test_flat_search_is_exact_inner_product(store, queries, flat):
    values, rows = flat.search(queries.vectors, 7)
    truth = queries.vectors @ store.read(0, len(store)).t()
    want_values, want_rows = torch.topk(truth, 7, dim=1)
    assert torch.equal(rows, want_rows)
    # FAISS's and torch's float32 GEMMs sum in different orders: round-off of a D-term dot product
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5 * float(truth.abs().max()))


@pytest.mark.parametrize("method", ["grad_dot", "grad_cos", "kfac"])
def test_shortlist_then_rerank_equals_exact_topk(store, queries, flat, method):
    options = {"curvature": Curvature.load(V1 / "curvature")} if method == "kfac" else {}
    index = build_index(store, IndexOptions(normalize=True)) if method == "grad_cos" else flat
    exact = _exact(method, store, queries, **options)
    attr = gradtrace.Attributor(method, store, block_rows=128, **options)
    # a shortlist of exactly k rows: equal to the exact top-k only if the index was searched with the *prepared*
    # query (the preconditioned one for kfac), since a flat index ranks by that query's exact inner product
    for rerank in (10, ROWS):
        approx = score_with_index(attr, queries, index, SearchOptions(rerank=rerank, topk=10))
        assert approx.matrix is None and approx.train_ids == store.ids and approx.query_ids == queries.ids
        for got, want in ((approx.top, exact.top), (approx.bottom, exact.bottom)):
            assert torch.equal(got[1], want[1])
            # the values are exact re-scores: the same entries of the exact matrix, to float32 round-off
            scale = float(exact.matrix.abs().max())
            torch.testing.assert_close(got[0], exact.matrix.gather(1, got[1]), rtol=1e-5, atol=1e-6 * scale)
        assert approx.topk(10).ids == exact.topk(10).ids
        assert approx.meta["index"]["rerank"] == rerank and approx.meta["method"] == method


def test_nprobe_for_a_flat_index_is_refused_not_ignored(store, queries, flat):
    attr = gradtrace.Attributor("grad_dot", store)
    for options in (SearchOptions(topk=5, nprobe=4), SearchOptions(topk=5, bottom_nprobe=2)):
        with pytest.raises(ValueError, match=r"is a flat index \(exact: it searches every row\): leave them unset"):
            score_with_index(attr, queries, flat, options)


def test_kfac_ranks_differently_from_grad_dot(store, queries):
    """The K-FAC test above is not grad_dot in disguise: the preconditioned query changes the top-k."""
    kfac = _exact("kfac", store, queries, curvature=Curvature.load(V1 / "curvature"))
    dot = _exact("grad_dot", store, queries)
    assert kfac.topk(10).ids != dot.topk(10).ids


def test_ivfpq_streams_the_store_and_recalls_the_exact_topk(store, queries, tmp_path):
    """IVF-PQ: trained on a sample, rows added in blocks (no read larger than a block); the index path finds the
    exact top-10 with a shortlist of 100, with exact values; a saved and loaded index searches the same."""
    reads: list[int] = []
    original = GradientStore.read

    def counting_read(self, start, stop, device=None):
        reads.append(min(stop, len(self)) - start)
        return original(self, start, stop, device)

    GradientStore.read = counting_read
    try:
        index = build_index(store, IndexOptions(kind="ivfpq", nlist=8, m=8, nbits=6, train_rows=300), block_rows=64)
    finally:
        GradientStore.read = original
    assert max(reads) <= 64 and sum(reads) == ROWS  # every row added once, in blocks
    assert len(index) == ROWS and index.params.factory() == "IVF8,PQ8x6"
    assert not index.faiss_index.do_polysemous_training  # minutes of annealing at m=256, for a search never used
    exact = _exact("grad_dot", store, queries)
    approx = score_with_index(gradtrace.Attributor("grad_dot", store), queries, index,
                              SearchOptions(rerank=100, topk=10, nprobe=4))
    hits = [len(set(a) & set(b)) for a, b in zip(approx.top[1].tolist(), exact.top[1].tolist())]
    assert sum(hits) / 60 >= 0.9, hits
    scale = float(exact.matrix.abs().max())
    torch.testing.assert_close(approx.top[0], exact.matrix.gather(1, approx.top[1]), rtol=1e-5, atol=1e-6 * scale)
    index.save(tmp_path / "index")
    loaded = Index.load(tmp_path / "index")
    assert loaded.params == index.params and loaded.fingerprint == store_fingerprint(store)
    for a, b in zip(loaded.search(queries.vectors, 50), index.search(queries.vectors, 50)):
        assert torch.equal(a, b)


def test_fast_scan_ivfpq_recalls_the_exact_topk(store, queries, tmp_path):
    """fast_scan: 4-bit codes, by default as many sub-quantizers as the largest divisor of the dimension <= dim / 8
    (232 = 8 x 29 dims -> 29), searched with FAISS's fast-scan kernels; the index path still finds the exact
    top-10 from a shortlist of 100, with exact values, and a saved index loads as built."""
    index = build_index(store, IndexOptions(kind="ivfpq", nlist=8, train_rows=300, fast_scan=True))
    assert index.params.fast_scan and index.params.nbits == 4 and index.params.m == 29
    assert index.params.factory() == "IVF8,PQ29x4fs" and len(index) == ROWS
    exact = _exact("grad_dot", store, queries)
    approx = score_with_index(gradtrace.Attributor("grad_dot", store), queries, index,
                              SearchOptions(rerank=100, topk=10, nprobe=4))
    hits = [len(set(a) & set(b)) for a, b in zip(approx.top[1].tolist(), exact.top[1].tolist())]
    assert sum(hits) / 60 >= 0.9, hits
    scale = float(exact.matrix.abs().max())
    for got in (approx.top, approx.bottom):
        torch.testing.assert_close(got[0], exact.matrix.gather(1, got[1]), rtol=1e-5, atol=1e-6 * scale)
    assert approx.meta["index"]["factory"] == "IVF8,PQ29x4fs"
    index.save(tmp_path / "fs")
    loaded = Index.load(tmp_path / "fs")
    assert loaded.params == index.params
    for a, b in zip(loaded.search(queries.vectors, 50), index.search(queries.vectors, 50)):
        assert torch.equal(a, b)


def test_fast_scan_options_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="fast-scan PQ codes are 4 bits wide; nbits=8"):
        IndexOptions(kind="ivfpq", nlist=8, nbits=8, train_rows=300, fast_scan=True)
    with pytest.raises(ValueError, match="fast_scan applies to kind='ivfpq'"):
        IndexOptions(kind="flat", fast_scan=True)
    assert IndexOptions(kind="auto", fast_scan=True).fast_scan  # auto with an ivfpq setting: ivfpq


def test_queries_whose_cells_hold_too_few_rows_search_more_cells(store, queries):
    """32 cells of ~19 rows and nprobe=1 cannot give 40 candidates: those queries are searched with more cells
    (recorded), and the kept scores are exact."""
    index = build_index(store, IndexOptions(kind="ivfpq", nlist=32, m=8, nbits=4, train_rows=ROWS))
    _, rows = index.search(queries.vectors, 100, nprobe=1)
    assert ((rows >= 0).sum(dim=1) < 40).any()
    approx = score_with_index(gradtrace.Attributor("grad_dot", store), queries, index,
                              SearchOptions(rerank=100, topk=40, nprobe=1))
    assert approx.meta["index"]["widened"]["top"] > 0
    exact = _exact("grad_dot", store, queries)
    assert len(set(approx.top[1][0].tolist())) == 40
    scale = float(exact.matrix.abs().max())
    for got in (approx.top, approx.bottom):
        torch.testing.assert_close(got[0], exact.matrix.gather(1, got[1]), rtol=1e-5, atol=1e-6 * scale)


def test_training_sample_is_seeded_and_within_size(store):
    rows_read: list[np.ndarray] = []
    original = GradientStore.rows

    def counting_rows(self, index, device=None):
        rows_read.append(np.asarray(index))
        return original(self, index, device)

    GradientStore.rows = counting_rows
    try:
        options = IndexOptions(kind="ivfpq", nlist=4, m=4, nbits=4, train_rows=200, seed=3)
        build_index(store, options, block_rows=64)
        first = np.concatenate(rows_read)
        rows_read.clear()
        build_index(store, options, block_rows=64)
    finally:
        GradientStore.rows = original
    assert len(first) == 200 and len(set(first.tolist())) == 200 and np.array_equal(first, np.concatenate(rows_read))


def test_changed_store_is_refused(store, flat, queries, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(store.root, root)
    copy = GradientStore.open(root)
    flat.check_store(copy)  # a copy holds the same rows: accepted
    index = build_index(copy)
    index.save(tmp_path / "index")
    writer = ShardWriter(root, copy.spec, StoreOptions(resume=True), rank=0, world_size=1)
    writer.put(["new"], torch.ones(1, copy.dim))
    writer.close()
    grown = GradientStore.open(root)
    with pytest.raises(IndexMismatch, match=r"store .* changed since index .* was built: it held 600 rows, it now "
                                            r"holds 601.*gradtrace index"):
        score_with_index(gradtrace.Attributor("grad_dot", grown), queries, Index.load(tmp_path / "index"))


def test_index_of_another_store_is_refused(store, spec, flat, queries, tmp_path):
    other = gradtrace.GradientSet(_clustered(ROWS, spec.dim, seed=7), store.ids, spec).save(tmp_path / "other")
    with pytest.raises(IndexMismatch, match=r"built from another store .*shard r00000-000000 differs"):
        score_with_index(gradtrace.Attributor("grad_dot", other), queries, flat)


@pytest.mark.parametrize("method, normalize", [("grad_cos", False), ("grad_dot", True)])
def test_normalization_must_fit_the_method(store, queries, method, normalize):
    index = build_index(store, IndexOptions(normalize=normalize))
    with pytest.raises(IndexMismatch, match=f"{method} needs an index of "
                                            f"{'normalized' if method == 'grad_cos' else 'raw'} rows"):
        score_with_index(gradtrace.Attributor(method, store), queries, index)


def test_multi_checkpoint_method_is_refused(store, queries, flat):
    attr = gradtrace.Attributor("tracin", [store, store], weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="tracin combines several checkpoints"):
        score_with_index(attr, [queries, queries], flat)


def test_nonfinite_query_is_refused(store, queries, flat, spec):
    vectors = queries.vectors.clone()
    vectors[3, 5] = float("nan")
    bad = gradtrace.GradientSet(vectors, queries.ids, spec)
    with pytest.raises(ValueError, match=r"query 'q3' .*NaN/inf"):
        score_with_index(gradtrace.Attributor("grad_dot", store), bad, flat)
    with pytest.raises(ValueError, match=r"query vector\(s\) \[3\] hold NaN/inf"):
        flat.search(vectors, 5)


def test_nonfinite_store_row_is_refused_and_names_it(store, tmp_path):
    """A store whose row 130 holds a NaN (written by another tool, checksums consistent) cannot be indexed."""
    root = tmp_path / "store"
    shutil.copytree(store.root, root)
    record_path = root / "shards" / "r00000-000001.json"
    record = json.loads(record_path.read_text())
    data = root / "shards" / record["files"]["data"]["name"]
    values = np.fromfile(data, dtype=np.float32).reshape(record["rows"], -1)
    values[2, 0] = np.nan  # row 128 + 2
    values.tofile(data)
    record["files"]["data"]["blake2b"] = checksum(values.tobytes())
    reseal_record(root, record)
    with pytest.raises(IndexMismatch, match=r"row 130 \(id 't130'\) holds NaN/inf"):
        build_index(GradientStore.open(root))
    with pytest.raises(IndexMismatch, match=r"row 130 \(id 't130'\) holds NaN/inf"):
        build_index(GradientStore.open(root), IndexOptions(kind="ivfpq", nlist=2, m=4, nbits=4, train_rows=ROWS))


def test_save_refuses_to_replace_and_keeps_the_old_index(store, flat, tmp_path):
    flat.save(tmp_path / "index")
    other = build_index(store, IndexOptions(normalize=True))
    with pytest.raises(IndexMismatch, match="already holds an index: pass overwrite=True"):
        other.save(tmp_path / "index")
    assert not Index.load(tmp_path / "index").normalized
    other.save(tmp_path / "index", overwrite=True)
    assert Index.load(tmp_path / "index").normalized
    with pytest.raises(IndexMismatch, match="is a gradient store"):
        flat.save(store.root)


def test_damaged_or_missing_index_is_refused(flat, tmp_path):
    with pytest.raises(IndexMismatch, match="holds no gradtrace index"):
        Index.load(tmp_path / "nothing")
    flat.save(tmp_path / "index")
    data = artifact_file(tmp_path / "index", json.loads((tmp_path / "index" / "index.json").read_text()), "faiss")
    data.write_bytes(b"not an index")
    with pytest.raises(IndexMismatch, match=r"index-faiss-.*truncated or replaced.*rebuild it"):
        Index.load(tmp_path / "index")
    save_v1(flat, tmp_path / "old")
    (tmp_path / "old" / "index.faiss").write_bytes(b"not an index")
    with pytest.warns(UncheckedArtifactWarning), pytest.raises(IndexMismatch, match=r"index\.faiss is damaged"):
        Index.load(tmp_path / "old")


def test_bad_parameters_are_refused(store):
    with pytest.raises(ValueError, match="m=7 must divide the store's dimension 232"):
        build_index(store, IndexOptions(kind="ivfpq", nlist=4, m=7, train_rows=300))
    with pytest.raises(ValueError, match="needs at least 256 training rows"):
        build_index(store, IndexOptions(kind="ivfpq", nlist=4, m=8, nbits=8, train_rows=100))
    with pytest.raises(ValueError, match=r"kind must be one of \('auto', 'flat', 'ivfpq'\), got 'hnsw'"):
        IndexOptions(kind="hnsw")
    with pytest.raises(TypeError, match=r"options= must be a gradtrace\.IndexOptions, got dict"):
        build_index(store, {"kind": "flat"})


def test_shortlist_smaller_than_k_is_refused(store, queries, flat):
    with pytest.raises(ValueError, match="rerank=5 is smaller than topk=10"):
        score_with_index(gradtrace.Attributor("grad_dot", store), queries, flat, SearchOptions(rerank=5, topk=10))


def test_missing_faiss_names_the_extra(store, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss raises ImportError
    with pytest.raises(FaissMissing, match=r"pip install 'gradtrace\[index\]'"):
        build_index(store)


@pytest.mark.parametrize("method", ["grad_dot", "grad_cos"])
@pytest.mark.parametrize("sub_rows", [2, None])
def test_rerank_of_int8_rows_equals_the_float64_scores_of_the_candidates(tmp_path, monkeypatch, method, sub_rows):
    """Re-scoring decodes each query's candidates in sub-blocks (grad_dot: unscaled, the scores scaled): the kept
    values are the float64 scores of the plainly decoded rows within the float32 bound, the kept rows a top-k of
    that query's candidates (unsorted, -1 padded), and only its own candidates are kept."""
    from gradtrace.score import engine
    from gradtrace.score.shortlist import rerank_exact
    from tests.store.common import DIM, make_rows, write
    from tests.store.test_decode import assert_topk_valid, float32_bound, plain_decode, reference_scores

    if sub_rows is not None:
        monkeypatch.setattr(engine, "SUB_BLOCK_BYTES", sub_rows * 4 * DIM)
        monkeypatch.setattr(engine.torch, "get_num_threads", lambda: 1)  # sub-blocks are for one thread
    ids, rows = make_rows(23)
    write(tmp_path, ids, rows, chunks=[23], dtype="int8")
    store = GradientStore.open(tmp_path)
    decoded = plain_decode(store)
    gen = torch.Generator().manual_seed(3)
    queries = torch.randn(4, DIM, generator=gen)
    candidates = torch.stack([torch.randperm(23, generator=gen)[:9] for _ in range(4)])
    candidates[1, 7:] = -1  # an IVF search that found fewer rows
    attr = gradtrace.Attributor(method, store)
    prepared = attr.method.prepare_queries(queries)
    unit = (lambda x: x / x.norm(dim=1, keepdim=True)) if method == "grad_cos" else (lambda x: x)
    reference = reference_scores(method, queries, decoded)
    bound = float32_bound(unit(queries), unit(decoded))
    for largest in (True, False):
        values, kept = rerank_exact(attr, store, prepared, candidates, 5, largest=largest)
        for q in range(4):
            mine = candidates[q][candidates[q] >= 0]
            assert set(kept[q].tolist()) <= set(mine.tolist())
            local = torch.tensor([mine.tolist().index(r) for r in kept[q].tolist()])
            assert_topk_valid(values[q:q + 1], local[None], reference[q:q + 1, mine], bound[q:q + 1, mine], largest)


def test_the_bottom_searches_its_own_number_of_cells(store, queries, monkeypatch):
    """bottom_nprobe: the negated query visits that many cells (the top keeps nprobe); with every cell visited the
    bottom-k's recall is higher than with the default, and its values stay exact re-scores."""
    index = build_index(store, IndexOptions(kind="ivfpq", nlist=32, m=8, nbits=6, train_rows=ROWS))
    seen: list[tuple[int, float]] = []
    original = Index.search

    def recording(self, vectors, r, *, nprobe=None):
        seen.append((nprobe, float(vectors[0, 0])))
        return original(self, vectors, r, nprobe=nprobe)

    exact = _exact("grad_dot", store, queries)
    attr = gradtrace.Attributor("grad_dot", store)
    default = score_with_index(attr, queries, index, SearchOptions(rerank=40, topk=10, nprobe=2))
    monkeypatch.setattr(Index, "search", recording)
    wide = score_with_index(attr, queries, index, SearchOptions(rerank=40, topk=10, nprobe=3, bottom_nprobe=32))
    assert seen[0] == (3, float(queries.vectors[0, 0])) and seen[-1] == (32, -float(queries.vectors[0, 0]))
    assert wide.meta["index"]["bottom_nprobe"] == 32 and default.meta["index"]["bottom_nprobe"] == 2

    def recall(got):
        return sum(len(set(a) & set(b)) for a, b in zip(got.bottom[1].tolist(), exact.bottom[1].tolist()))

    assert recall(wide) > recall(default)  # 50 / 60 against 21 / 60: the most negative rows lie in many cells
    scale = float(exact.matrix.abs().max())
    torch.testing.assert_close(wide.bottom[0], exact.matrix.gather(1, wide.bottom[1]), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("build, line", [
    (lambda: IndexOptions(nlist=0), "nlist must be an integer >= 1, got 0"),
    (lambda: IndexOptions(nbits=17), "nbits must be an integer in [1, 16], got 17"),
    (lambda: IndexOptions(m=2.5), "m must be an integer >= 1, got 2.5"),
    (lambda: IndexOptions(train_rows=-1), "train_rows must be an integer >= 1, got -1"),
    (lambda: IndexOptions(seed=2**64), "seed must be a 64-bit integer"),
    (lambda: SearchOptions(topk=0), "topk must be an integer >= 1, got 0"),
    (lambda: SearchOptions(rerank=0), "rerank must be an integer >= 1, got 0"),
    (lambda: SearchOptions(nprobe=-2), "nprobe must be an integer >= 1, got -2"),
    (lambda: SearchOptions(bottom_nprobe=True), "bottom_nprobe must be an integer >= 1, got True"),
])
def test_a_bad_number_is_refused_when_the_options_are_made(build, line):
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_index_options_build_the_faiss_index_they_describe(store, queries):
    """An ivfpq index built from IndexOptions is the FAISS index of the same factory string, trained on the seeded
    sample and holding every row: the same search results, saved as the same parameters; ``kind="auto"`` builds
    the flat index of a 600-row store, with its reason."""
    import faiss

    options = IndexOptions(kind="ivfpq", nlist=8, m=8, nbits=6, train_rows=300, seed=4)
    index = build_index(store, options, block_rows=100)
    assert index.params == IndexParams("ivfpq", False, 8, 8, 6, 8, 300, 4, False)
    rows = store.read(0, len(store)).numpy()
    reference = faiss.index_factory(store.dim, "IVF8,PQ8x6", faiss.METRIC_INNER_PRODUCT)
    reference.do_polysemous_training = False
    picked = torch.randperm(ROWS, generator=torch.Generator().manual_seed(4))[:300].sort().values.numpy()
    reference.train(rows[picked])
    reference.add(rows)
    for nprobe in (2, 8):
        faiss.extract_index_ivf(reference).nprobe = nprobe
        want_values, want_rows = reference.search(queries.vectors.numpy(), 20)
        got_values, got_rows = index.search(queries.vectors, 20, nprobe=nprobe)
        assert np.array_equal(got_rows.numpy(), want_rows) and np.array_equal(got_values.numpy(), want_values)
    auto = build_index(store, IndexOptions(kind="auto"))
    assert auto.params == build_index(store).params == IndexParams("flat", False, None, None, None, None, 65536, 0)
    assert "600 rows, fewer than 10,000" in auto.meta["auto_kind"]


def test_search_options_search_what_they_say(store, queries, tmp_path):
    """SearchOptions' nprobe and bottom_nprobe are the cells searched, and recorded; an index saved with another
    default nprobe (older builds chose it) searches that one unless told otherwise."""
    index = build_index(store, IndexOptions(kind="ivfpq", nlist=16, m=8, nbits=4, train_rows=ROWS))
    attr = gradtrace.Attributor("grad_dot", store)
    got = score_with_index(attr, queries, index, SearchOptions(topk=5, rerank=30, nprobe=2, bottom_nprobe=6))
    assert got.meta["index"]["nprobe"] == 2 and got.meta["index"]["bottom_nprobe"] == 6
    assert got.meta["index"]["rerank"] == 30 and got.top[1].shape == (6, 5)
    prepared = attr.method.prepare_queries(queries.vectors)
    from gradtrace.score.shortlist import rerank_exact, search_enough

    for side, sign, probe, largest in (("top", 1.0, 2, True), ("bottom", -1.0, 6, False)):
        candidates, _ = search_enough(index, prepared * sign, 30, 5, probe)
        values, rows = rerank_exact(attr, store, prepared, candidates, 5, largest=largest)
        assert torch.equal(getattr(got, side)[1], rows) and torch.equal(getattr(got, side)[0], values)
    index.params = replace(index.params, nprobe=2)  # as saved by a build that chose nprobe=2
    index.save(tmp_path / "old")
    old = Index.load(tmp_path / "old")
    assert old.params.nprobe == 2
    default = score_with_index(attr, queries, old, SearchOptions(topk=5, rerank=30, bottom_nprobe=6))
    assert default.meta["index"]["nprobe"] == 2 and torch.equal(default.top[1], got.top[1])
    top_only = score_with_index(attr, queries, old, SearchOptions(topk=5, rerank=30, nprobe=2, bottom=False))
    assert top_only.bottom is None and torch.equal(top_only.top[1], got.top[1])
