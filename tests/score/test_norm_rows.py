"""The norm shortlist of the index path (issue #14): every row's L2 norm is recorded with the index (or attached
later), and ``score_with_index(..., SearchOptions(norm_rows=N))`` scores the N rows of largest norm for every query,
so that a bottom-k made of large-norm rows scattered over IVF cells is found exactly; refusals are one clear
error."""

from __future__ import annotations

import json

import pytest
import torch

import gradtrace
from gradtrace.options.index import IndexOptions, SearchOptions
from gradtrace.score import shortlist
from gradtrace.score.index import Index, IndexMismatch, build_index
from gradtrace.score.shortlist import score_with_index
from gradtrace.store import GradientSpec
from gradtrace.store.artifact import UncheckedArtifactWarning, artifact_file
from tests.score.legacy_index import save_v1

pytest.importorskip("faiss")

DIM = 64
CLUSTERS = 12
ROWS = 400
OUTLIERS = 40  # rows 0..39 of the store: norm ~20x the others, direction = a cluster centre + a lot of noise
K = 8
SPEC = GradientSpec([("synthetic.weight", DIM)], None, {"reduction": "sum", "example_loss": "sum"})
U = 2.0**-24  # float32 unit round-off


def one_cell(**options) -> SearchOptions:
    """Search options visiting one IVF cell per query: a query's own cells for the top, one cell for the bottom."""
    return SearchOptions(nprobe=1, topk=K, **options)


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ROWS`` rows in ``CLUSTERS`` tight clusters of norm ~1; the first ``OUTLIERS`` are 20x longer, each near a
    cluster centre (so IVF files them in that cluster's cell) plus noise twice the centre's size. Also the
    cluster centres."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLUSTERS, DIM, generator=gen)
    centres /= centres.norm(dim=1, keepdim=True)
    which = torch.arange(ROWS) % CLUSTERS
    noise = torch.randn(ROWS, DIM, generator=gen) / DIM**0.5
    rows = centres[which] + 0.3 * noise
    rows[:OUTLIERS] = 20.0 * (centres[which[:OUTLIERS]] + 2.0 * noise[:OUTLIERS])
    return rows, centres


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The int8 store (so scales are folded into the shared rows' scores too), six queries (each a mix of two
    cluster centres), and the exact scores of every (query, row)."""
    rows, centres = _rows(seed=5)
    store = gradtrace.GradientSet(rows, [f"t{i}" for i in range(ROWS)], SPEC).save(
        tmp_path_factory.mktemp("normrows") / "store", dtype="int8", shard_rows=96)
    gen = torch.Generator().manual_seed(6)
    vectors = centres[torch.arange(6)] + 0.7 * centres[torch.arange(6) + 6] + 0.1 * torch.randn(6, DIM, generator=gen)
    queries = gradtrace.GradientSet(vectors, [f"q{i}" for i in range(6)], SPEC)
    exact = gradtrace.Attributor("grad_dot", store, block_rows=64).score(queries, topk=K, matrix=True)
    return store, queries, exact


@pytest.fixture(scope="module")
def ivf(data) -> Index:
    """12 cells (searched one per query: :func:`one_cell`)."""
    return build_index(data[0], IndexOptions(kind="ivfpq", nlist=CLUSTERS, m=8, nbits=4, train_rows=ROWS))


def _bound(store, queries) -> float:
    """Two float32 computations of a ``DIM``-term dot product (then a scale) differ by at most
    ``2 (DIM + 2) u |q| |x|``; the largest ``|q| |x|`` bounds every pair."""
    return 2 * (DIM + 2) * U * float(queries.vectors.norm(dim=1).max() * store.read(0, len(store)).norm(dim=1).max())


def _assert_exact(got, exact, store, queries) -> None:
    """``got``'s top and bottom are the exact ones: the same rows, the values within the float32 bound."""
    for mine, want in ((got.top, exact.top), (got.bottom, exact.bottom)):
        assert torch.equal(mine[1], want[1])
        torch.testing.assert_close(mine[0], want[0], rtol=0, atol=_bound(store, queries))


def test_bottom_k_is_made_of_scattered_large_norm_rows(data, ivf):
    """The store does what the tests below need: every query's exact bottom-k is outliers, spread over >= 4 cells."""
    store, _, exact = data
    assert bool((exact.bottom[1] < OUTLIERS).all())
    _, cells = ivf.faiss_index.quantizer.search(store.read(0, OUTLIERS).numpy(), 1)
    for q in range(6):
        assert len({int(cells[r, 0]) for r in exact.bottom[1][q].tolist()}) >= 4


def test_norm_rows_covering_the_outliers_give_the_exact_bottom_k(data, ivf):
    store, queries, exact = data
    attr = gradtrace.Attributor("grad_dot", store)
    plain = score_with_index(attr, queries, ivf, one_cell(rerank=20))
    hits = sum(len(set(a) & set(b)) for a, b in zip(plain.bottom[1].tolist(), exact.bottom[1].tolist()))
    assert hits < 0.75 * 6 * K  # without the norm rows the bottom-k is mostly missed: the test is meaningful
    got = score_with_index(attr, queries, ivf, one_cell(rerank=20, norm_rows=OUTLIERS))
    _assert_exact(got, exact, store, queries)
    assert got.meta["index"]["norm_rows"] == OUTLIERS and plain.meta["index"]["norm_rows"] == 0


def test_the_shared_rows_are_scored_once_for_top_and_bottom(data, ivf, monkeypatch):
    store, queries, _ = data
    calls: list[int] = []
    original = shortlist.score_norm_rows

    def counting(attributor, store, prepared, norms, n, k, **options):
        calls.append(len(prepared))
        return original(attributor, store, prepared, norms, n, k, **options)

    monkeypatch.setattr(shortlist, "score_norm_rows", counting)
    score_with_index(gradtrace.Attributor("grad_dot", store), queries, ivf, one_cell(rerank=20, norm_rows=OUTLIERS))
    assert calls == [6]  # one [Q, N] product for all queries, top and bottom


def test_rows_in_both_shortlists_are_kept_once(data):
    """A flat index with a shortlist of exactly k: its candidates are the exact top-k, which the 60 norm rows
    largely contain too; no id repeats, and the result is exact."""
    store, queries, exact = data
    flat = build_index(store)
    got = score_with_index(gradtrace.Attributor("grad_dot", store), queries, flat,
                           SearchOptions(rerank=K, topk=K, norm_rows=60))
    overlap = [len(set(a) & set(range(OUTLIERS))) for a in exact.top[1].tolist()]
    assert min(overlap) > 0  # the top-k's candidates and the norm rows do overlap
    for _, rows in (got.top, got.bottom):
        assert all(len(set(r)) == K for r in rows.tolist())
    _assert_exact(got, exact, store, queries)


def test_norm_rows_covering_the_store_give_the_exact_top_and_bottom(data, ivf):
    store, queries, exact = data
    got = score_with_index(gradtrace.Attributor("grad_dot", store), queries, ivf,
                           one_cell(rerank=K, norm_rows=ROWS + 5))
    _assert_exact(got, exact, store, queries)
    assert got.meta["index"]["norm_rows"] == ROWS


def _float32_norms(store) -> torch.Tensor:
    return torch.linalg.norm(store.read(0, len(store)), dim=1)


def test_saved_norms_equal_a_direct_computation(data, ivf, tmp_path):
    store = data[0]
    ivf.save(tmp_path / "index")
    info = json.loads((tmp_path / "index" / "index.json").read_text())
    assert info["tensors"]["index"] == {"row_norms": {"dtype": "float32", "shape": [ROWS]}}
    assert (tmp_path / "index" / info["tensors"]["file"]).stat().st_size == info["tensors"]["bytes"] <= 4 * ROWS + 256
    loaded = Index.load(tmp_path / "index")
    # two float32 sums of DIM squares: each within (DIM / 2 + 1) u of the true norm
    torch.testing.assert_close(loaded.row_norms, _float32_norms(store), rtol=(DIM + 2) * U, atol=0)
    assert torch.equal(loaded.row_norms, ivf.row_norms)


def test_normalized_index_records_raw_norms_and_refuses_norm_rows(data):
    store, queries, _ = data
    index = build_index(store, IndexOptions(normalize=True))
    torch.testing.assert_close(index.row_norms, _float32_norms(store), rtol=(DIM + 2) * U, atol=0)
    with pytest.raises(IndexMismatch, match=r"normalized rows \(grad_cos\): every row has norm 1.*drop norm_rows"):
        score_with_index(gradtrace.Attributor("grad_cos", store), queries, index,
                         SearchOptions(topk=K, norm_rows=10))


def _old_style(index: Index, where) -> None:
    """Save ``index`` as gradtrace saved it before norms were recorded: version 1, no row_norms.npy."""
    save_v1(index, where, norms=False)


def test_attach_row_norms_upgrades_an_old_index(data, ivf, tmp_path):
    store, queries, exact = data
    where = tmp_path / "old"
    _old_style(ivf, where)
    faiss_bytes = (where / "index.faiss").read_bytes()
    with pytest.warns(UncheckedArtifactWarning, match="without checksums"):
        old = Index.load(where)
    assert old.row_norms is None
    attr = gradtrace.Attributor("grad_dot", store)
    plain = score_with_index(attr, queries, old, one_cell(rerank=20))  # works as before
    assert torch.equal(plain.top[1], score_with_index(attr, queries, ivf, one_cell(rerank=20)).top[1])
    with pytest.raises(IndexMismatch, match=r"records no row norms .*gradtrace index .* --out .*old --add-norms"):
        score_with_index(attr, queries, old, one_cell(norm_rows=10))
    norms = old.attach_row_norms(store, block_rows=50)
    torch.testing.assert_close(norms, ivf.row_norms, rtol=(DIM + 2) * U, atol=0)
    again = Index.load(where)  # saved again as a checksummed index: no warning
    assert artifact_file(where, json.loads((where / "index.json").read_text()), "faiss").read_bytes() == faiss_bytes
    assert not (where / "index.faiss").exists()  # no rebuild: the FAISS data moved as it was
    assert torch.equal(again.row_norms, norms)
    _assert_exact(score_with_index(attr, queries, again, one_cell(rerank=20, norm_rows=OUTLIERS)), exact, store,
                  queries)


def test_attach_refuses_another_store_before_reading_it(data, ivf, tmp_path):
    rows, _ = _rows(seed=9)
    other = gradtrace.GradientSet(rows, data[0].ids, SPEC).save(tmp_path / "other", dtype="int8")
    old = Index(ivf.faiss_index, ivf.params, ivf.fingerprint, ivf.meta)
    with pytest.raises(IndexMismatch, match="built from another store"):
        old.attach_row_norms(other)
    assert old.row_norms is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_norms_file_of_a_version_1_index_is_refused(ivf, tmp_path, damage):
    where = tmp_path / "index"
    save_v1(ivf, where)
    path = where / "row_norms.npy"
    data = bytearray(path.read_bytes())
    if damage == "delete":
        path.unlink()
    else:
        if damage == "truncate":
            data = data[:-4]
        else:
            data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    what = "missing" if damage == "delete" else "damaged"
    with pytest.warns(UncheckedArtifactWarning), \
            pytest.raises(IndexMismatch, match=rf"row_norms.npy.*{what}.*--add-norms"):
        Index.load(where)
    with pytest.warns(UncheckedArtifactWarning):
        assert Index.load(where, row_norms=False).row_norms is None  # the rest of the index still opens


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_norms_of_an_index_are_refused(ivf, tmp_path, damage):
    where = tmp_path / "index"
    ivf.save(where)
    path = where / json.loads((where / "index.json").read_text())["tensors"]["file"]
    data = bytearray(path.read_bytes())
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data[:-4] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 0x40])))
    what = {"delete": "is missing", "truncate": "truncated or replaced", "flip": "corrupted or was replaced"}[damage]
    for norms in (True, False):  # the norms are part of the checksummed index: refused either way
        with pytest.raises(IndexMismatch, match=rf"{what}.*rebuild it: gradtrace index STORE --out"):
            Index.load(where, row_norms=norms)


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_bad_norm_rows_is_refused(value):
    with pytest.raises(ValueError, match=r"norm_rows must be an integer >= 0"):
        SearchOptions(norm_rows=value)


def test_a_search_with_more_cells_does_not_change_the_saved_index(data, ivf, tmp_path):
    """``search(nprobe=...)`` (as the shortlist widens) leaves the FAISS object with the nprobe it was built with,
    so a later save (``attach_row_norms``) writes the same FAISS data."""
    import faiss

    assert ivf.params.nprobe == ivf.params.nlist  # min(nlist, 16) by default: search with fewer
    before = faiss.serialize_index(ivf.faiss_index).tobytes()
    ivf.search(torch.randn(2, ivf.dim, generator=torch.Generator().manual_seed(0)), 5, nprobe=1)
    assert faiss.serialize_index(ivf.faiss_index).tobytes() == before
