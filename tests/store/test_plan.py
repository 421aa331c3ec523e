"""``gradtrace.plan``: the numbers of a collection before it runs, checked against the store it then writes."""

import pytest
import torch

import gradtrace
from gradtrace.plan import RECORD_BYTES_PER_ROW, free_space
from tests import tiny


def _lm_batches(n: int = 10, batch: int = 4, length: int = 6):
    tokens = torch.randint(0, tiny.VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, 4:] = 0  # a padded example: its padding is not counted
    return [{"input_ids": tokens[s:s + batch], "attention_mask": mask[s:s + batch], "labels": tokens[s:s + batch]}
            for s in range(0, n, batch)]


def test_plan_matches_the_store_collect_writes(tmp_path):
    torch.manual_seed(0)
    model = tiny.gpt2()
    data, logra = _lm_batches(), gradtrace.LoGra(rank=2)
    got = gradtrace.plan(model, data, projection=logra, dtype="int8", store=tmp_path / "s")
    store = gradtrace.collect(model, data, projection=logra, dtype="int8", store=tmp_path / "s")
    assert got.examples == len(store) == 10 and got.tokens == 10 * 6 - 2
    assert got.dim == store.dim and got.params == len(store.spec.params)
    assert got.bytes_per_example == store.dim + 4  # int8 values and a float32 scale
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "s" / "shards").glob("*.data")) + \
        sum(f.stat().st_size for f in (tmp_path / "s" / "shards").glob("*.scale"))
    assert data_bytes == 10 * got.bytes_per_example
    assert got.store_bytes == 10 * (got.bytes_per_example + RECORD_BYTES_PER_ROW)
    assert got.free_bytes > got.store_bytes and got.fits and got.seconds > 0


def test_plan_refuses_a_one_shot_generator():
    with pytest.raises(ValueError, match="iterates data twice"):
        gradtrace.plan(tiny.MLP(), (b for b in [(torch.randn(2, 7), torch.tensor([0, 1]))]))


def test_free_space_of_a_path_not_created_yet(tmp_path):
    assert free_space(tmp_path / "a" / "b") == free_space(tmp_path) > 0
