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


@pytest.mark.parametrize("block_rows", [4, 8192])
def test_streaming_scores_with_the_reused_buffer_equal_plain_scores(store, block_rows):
    """The engine decodes every block into one buffer: scores equal those of the plainly decoded rows."""
    queries = gradtrace.GradientSet(torch.randn(3, DIM, generator=torch.Generator().manual_seed(1)),
                                    ["a", "b", "c"], store.spec)
    plain = gradtrace.GradientSet(plain_decode(store), store.ids, store.spec)
    for method in ("grad_dot", "grad_cos"):  # grad_cos transforms the decoded rows (prepare_train)
        got = gradtrace.Attributor(method, store, block_rows=block_rows).score(queries, topk=5, matrix=True)
        want = gradtrace.Attributor(method, plain, block_rows=block_rows).score(queries, topk=5, matrix=True)
        assert torch.equal(got.matrix, want.matrix)
        assert torch.equal(got.top[1], want.top[1]) and torch.equal(got.bottom[1], want.bottom[1])


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
