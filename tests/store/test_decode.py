"""The optimised decode paths (into caller buffers, one gather per shard, no intermediate copies) give exactly the
plain decode of the stored bytes: ``float32(raw)`` for fp32/bf16, ``float32(raw) * scale`` for int8."""

import numpy as np
import pytest
import torch

import gradtrace
from gradtrace.store import GradientStore
from tests.store.common import DIM, make_rows, write

CHUNKS = [3, 7, 1, 12]  # 23 rows in shards of 5: 5, 5, 5, 5 and a partial 3
DTYPES = ["float32", "bfloat16", "int8"]


def plain_decode(store: GradientStore) -> torch.Tensor:
    """Every row decoded straight from the shard files with numpy, the obvious way: ``[N, D]`` float32."""
    parts = []
    for shard in store.shards:
        files = shard.record["files"]
        path = store.root / "shards"
        if store.spec.dtype == "float32":
            parts.append(torch.from_numpy(np.fromfile(path / files["data"]["name"], dtype=np.float32)))
        elif store.spec.dtype == "bfloat16":
            raw = np.fromfile(path / files["data"]["name"], dtype=np.int16)
            parts.append(torch.from_numpy(raw).view(torch.bfloat16).to(torch.float32))
        else:
            raw = np.fromfile(path / files["data"]["name"], dtype=np.int8).astype(np.float32).reshape(shard.rows, -1)
            scale = np.fromfile(path / files["scale"]["name"], dtype=np.float32)
            parts.append(torch.from_numpy(raw * scale[:, None]))
    return torch.cat([p.reshape(-1, store.dim) for p in parts])


@pytest.fixture(params=DTYPES)
def store(tmp_path, request):
    ids, rows = make_rows(23)
    write(tmp_path, ids, rows, chunks=CHUNKS, dtype=request.param)
    return GradientStore.open(tmp_path)


def test_read_equals_plain_decode_with_and_without_a_buffer(store):
    expected = plain_decode(store)
    assert torch.equal(store.read(0, 23), expected)
    buffer = torch.full((7, DIM), float("nan"))
    got = store.read(4, 11, out=buffer)  # across two shard boundaries
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected[4:11])
    assert torch.equal(store.read(20, 40, out=torch.empty(3, DIM)), expected[20:])  # clipped to the store


@pytest.mark.parametrize("block", [1, 4, 5, 7, 23, 100])
def test_iter_blocks_reusing_one_buffer_equals_plain_decode(store, block):
    expected = plain_decode(store)
    pointers = set()
    for start, rows in store.iter_blocks(block, reuse=True):
        assert torch.equal(rows, expected[start:start + block])
        pointers.add(rows.data_ptr())
    assert len(pointers) == 1  # one buffer for every block


@pytest.mark.parametrize("index", [
    [2, 3, 4, 5, 6, 7],             # sorted runs across a shard boundary: slices
    [0, 2, 9, 10, 17, 22],          # sorted, gaps: gathers
    [0, 0, 2],                      # repeats whose span equals their count (not a run)
    [22, 0, 13, 13, 5, 4, 21, 1],   # unsorted with repeats
    [],
])
def test_rows_equals_plain_decode(store, index):
    expected = plain_decode(store)
    assert torch.equal(store.rows(index), expected[torch.tensor(index, dtype=torch.long)])
    buffer = torch.empty(len(index), DIM)
    assert store.rows(index, out=buffer).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer, expected[torch.tensor(index, dtype=torch.long)])


def test_decoding_leaves_the_files_intact_and_a_fresh_read_is_the_callers(store):
    first = store.read(0, 23)
    first.fill_(0)  # a returned tensor is the caller's, never a view of the mapping
    assert torch.equal(store.read(0, 23), plain_decode(store))
    GradientStore.open(store.root, verify=True)  # data checksums still match


def test_a_wrong_buffer_is_refused_naming_its_shape(store):
    with pytest.raises(ValueError, match=r"shape \(7, \d+\) for 7 rows of store .*got torch.float32 \(6, \d+\)"):
        store.read(4, 11, out=torch.empty(6, DIM))
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        store.read(4, 11, out=torch.empty(7, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        store.read(0, 5, out=torch.empty(DIM, 5).t())


def plain_parts(store: GradientStore) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored values as float32 (int8: unscaled integers) and the per-row scales (1 without int8)."""
    rows = plain_decode(store)
    if store.spec.dtype != "int8":
        return rows, torch.ones(len(rows))
    scales = torch.cat([torch.from_numpy(np.fromfile(store.root / "shards" / s.record["files"]["scale"]["name"],
                                                     dtype=np.float32)) for s in store.shards])
    raw = torch.cat([torch.from_numpy(np.fromfile(store.root / "shards" / s.record["files"]["data"]["name"],
                                                  dtype=np.int8).astype(np.float32)) for s in store.shards])
    return raw.reshape(-1, store.dim), scales


def test_reading_unscaled_rows_with_their_scales_equals_plain_decode(store):
    raw, scales = plain_parts(store)
    got_scales = torch.full((7,), float("nan"))
    got = store.read(4, 11, scales=got_scales)  # across two shard boundaries
    assert torch.equal(got, raw[4:11]) and torch.equal(got_scales, scales[4:11])
    index = [22, 0, 13, 13, 5, 4, 21, 1]  # unsorted with repeats
    got_scales = torch.empty(len(index))
    got = store.rows(index, out=torch.empty(len(index), DIM), scales=got_scales)
    assert torch.equal(got, raw[index]) and torch.equal(got_scales, scales[index])
    assert torch.equal(got * got_scales[:, None], plain_decode(store)[index])  # exactly the scaled decode
    with pytest.raises(ValueError, match=r"scales must be a contiguous float32 CPU tensor of shape \(7,\)"):
        store.read(4, 11, scales=torch.empty(6))


def float32_bound(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A worst-case bound on the float32 error of ``queries @ rows.T`` against float64, whatever the summation
    order (``gamma_n`` for a dot product of ``D`` terms, ``n = D + 2``: one more rounding each for the int8 scale
    and the decode), doubled for ``grad_cos`` (each normalization adds at most ``(D / 2 + 3) u`` per element)."""
    unit = 2.0 ** -24
    return 2 * (queries.shape[1] + 4) * unit * (queries.double().abs() @ rows.double().abs().t())


def reference_scores(method: str, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Scores in float64 from the plainly decoded rows."""
    q, r = queries.double(), rows.double()
    if method == "grad_cos":
        q, r = q / q.norm(dim=1, keepdim=True), r / r.norm(dim=1, keepdim=True)
    return q @ r.t()


def assert_topk_valid(values: torch.Tensor, rows: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor,
                      largest: bool) -> None:
    """Each kept value is its row's reference score within the bound, and the kept rows are a top-k of the
    reference up to the bound (a row may only swap with one whose score is within twice the bound)."""
    picked, tol = reference.gather(1, rows), bound.gather(1, rows)
    assert bool(((values.double() - picked).abs() <= tol).all())
    sign = 1 if largest else -1
    kth = (sign * reference).topk(rows.shape[1], dim=1).values[:, -1:]
    assert bool((sign * picked >= kth - 2 * bound.max(dim=1, keepdim=True).values).all())


@pytest.mark.parametrize("sub_rows", [1, 3, 7, None])
@pytest.mark.parametrize("block_rows", [4, 8192])
def test_streaming_scores_in_sub_blocks_equal_the_plainly_decoded_scores(store, block_rows, sub_rows, monkeypatch):
    """The engine decodes each block sub-block by sub-block into one buffer and, for methods that score raw rows,
    scales the scores instead of the int8 rows: the scores equal those of the plainly decoded rows in float64
    within the float32 bound, and the kept rows are a top-k of them."""
    from gradtrace.score import engine

    if sub_rows is not None:
        monkeypatch.setattr(engine, "SUB_BLOCK_BYTES", sub_rows * 4 * DIM)
        monkeypatch.setattr(engine.torch, "get_num_threads", lambda: 1)  # sub-blocks are for one thread
    queries = torch.randn(3, DIM, generator=torch.Generator().manual_seed(1))
    query_set = gradtrace.GradientSet(queries, ["a", "b", "c"], store.spec)
    rows = plain_decode(store)
    for method in ("grad_dot", "grad_cos"):  # grad_cos transforms the decoded rows (prepare_train)
        got = gradtrace.Attributor(method, store, block_rows=block_rows).score(query_set, topk=5, matrix=True)
        reference = reference_scores(method, queries, rows)
        unit = (lambda x: x / x.norm(dim=1, keepdim=True)) if method == "grad_cos" else (lambda x: x)
        bound = float32_bound(unit(queries), unit(rows))
        assert bool(((got.matrix.double() - reference).abs() <= bound).all())
        assert_topk_valid(*got.top, reference, bound, largest=True)
        assert_topk_valid(*got.bottom, reference, bound, largest=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [(0, 0), (2, 22), (1, 13)])
def test_the_streaming_check_finds_one_bad_score_anywhere(bad, where):
    """The finiteness check of every streamed block (one min/max pass) sees a single NaN, +inf or -inf."""
    from gradtrace.score.engine import ScoringError, _check_block

    scores = torch.randn(3, 23, generator=torch.Generator().manual_seed(2))
    _check_block(scores, ["a", "b", "c"], [f"r{i}" for i in range(30)], 7, "grad_dot")  # finite: no error
    scores[where] = bad
    with pytest.raises(ScoringError, match=rf"queries \['{'abc'[where[0]]}'\] against training rows "
                                           rf"{7 + where[1]}\.\.{7 + where[1]} \(ids \['r{7 + where[1]}'\]\)"):
        _check_block(scores, ["a", "b", "c"], [f"r{i}" for i in range(30)], 7, "grad_dot")


def test_checkpoints_streamed_from_int8_stores_in_sub_blocks_equal_the_weighted_sum(tmp_path, monkeypatch):
    """TracIn over two int8 stores (a method that combines checkpoints): each checkpoint's product is streamed in
    sub-blocks, weighted and summed: the learning-rate weighted sum of the float64 reference scores."""
    from gradtrace.score import engine

    monkeypatch.setattr(engine, "SUB_BLOCK_BYTES", 3 * 4 * DIM)
    monkeypatch.setattr(engine.torch, "get_num_threads", lambda: 1)
    stores, decoded = [], []
    for seed in (0, 1):
        ids, rows = make_rows(23, seed=seed)
        ids = [f"ex-{i}" for i in range(23)]
        write(tmp_path / f"c{seed}", ids, rows, chunks=CHUNKS, dtype="int8")
        stores.append(GradientStore.open(tmp_path / f"c{seed}"))
        decoded.append(plain_decode(stores[-1]))
    gen = torch.Generator().manual_seed(4)
    queries = [torch.randn(2, DIM, generator=gen) for _ in stores]
    query_sets = [gradtrace.GradientSet(q, ["a", "b"], stores[0].spec) for q in queries]
    method = gradtrace.fit.methods.get_method("tracin", weights=[0.5, 2.0])
    got = gradtrace.Attributor(method, stores, block_rows=8).score(query_sets, topk=4, matrix=True)
    reference = 0.5 * reference_scores("grad_dot", queries[0], decoded[0]) \
        + 2.0 * reference_scores("grad_dot", queries[1], decoded[1])
    bound = 0.5 * float32_bound(queries[0], decoded[0]) + 2.0 * float32_bound(queries[1], decoded[1])
    assert bool(((got.matrix.double() - reference).abs() <= 2 * bound).all())  # one more rounding per sum
