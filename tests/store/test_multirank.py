"""Ranks write their own shards into one directory; readers merge them (no torch.distributed needed)."""

import pytest
import torch

from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter, SpecMismatch, StoreError
from tests.store.common import PROJECTION, make_rows, make_spec, status


def test_two_ranks_interleaved_make_one_store(tmp_path):
    ids0, rows0 = make_rows(7, seed=0)
    ids1, rows1 = make_rows(5, seed=1)
    # rank 1 arrives first
    rank1 = ShardWriter(tmp_path, make_spec("bfloat16"), StoreOptions(shard_rows=3), rank=1, world_size=2)
    rank0 = ShardWriter(tmp_path, make_spec("bfloat16"), StoreOptions(shard_rows=3), rank=0, world_size=2)
    for k in range(0, 7, 2):
        rank0.put(ids0[k:k + 2], rows0[k:k + 2], {"step": [k // 2] * len(ids0[k:k + 2])})
        if k < 5:
            rank1.put(ids1[k:k + 2], rows1[k:k + 2], {"step": [k // 2] * len(ids1[k:k + 2])})
    rank0.close()
    with pytest.raises(StoreError, match=r"incomplete \(rank 1: writing, writer pid \d+ .* still holds the lock\)"):
        GradientStore.open(tmp_path)
    partial = GradientStore.open(tmp_path, allow_incomplete=True)
    assert partial.ids[:7] == ids0 and set(partial.ids[7:]) <= set(ids1)  # rank 1's committed shards
    assert not partial.complete
    rank1.close()

    store = GradientStore.open(tmp_path)
    assert store.complete and store.ranks.keys() == {0, 1}
    assert store.ids == ids0 + ids1
    assert torch.equal(store.read(0, 12), torch.cat([rows0, rows1]).to(torch.bfloat16).float())
    assert store.field("step") == [0, 0, 1, 1, 2, 2, 3, 0, 0, 1, 1, 2]
    assert [(s.rank, s.rows) for s in store.shards] == [(0, 3), (0, 3), (0, 1), (1, 3), (1, 2)]
    assert store.index_of([ids1[4], ids0[0]]) == [11, 0]
    assert torch.equal(store.rows([11, 0]), torch.cat([store.read(11, 12), store.read(0, 1)]))


def test_ranks_one_after_another_and_a_missing_rank(tmp_path):
    ids0, rows0 = make_rows(4, seed=0)
    ids1, rows1 = make_rows(4, seed=1)
    with ShardWriter(tmp_path, make_spec(), rank=0, world_size=2) as rank0:
        rank0.put(ids0, rows0)
    with pytest.raises(StoreError, match=r"incomplete \(rank 1: missing\)"):
        GradientStore.open(tmp_path)
    with ShardWriter(tmp_path, make_spec(), rank=1, world_size=2) as rank1:
        assert rank1.stored_ids == set(ids0)  # what rank 0 committed is not written again
        rank1.put(ids1 + ids0[:1], torch.cat([rows1, rows0[:1]]))
    store = GradientStore.open(tmp_path)
    assert store.ids == ids0 + ids1 and torch.equal(store.read(0, 8), torch.cat([rows0, rows1]))
    assert status(tmp_path, 1)["skipped"]["already_stored"] == 1


@pytest.mark.parametrize("change, message", [
    ({"projection": {**PROJECTION, "rank_rows": 9}}, "different projections"),
    ({"convention": {"reduction": "mean", "example_loss": "mean"}}, "different loss conventions"),
    ({"dtype": "int8"}, "stores float32, this run writes int8"),
])
def test_a_rank_with_another_spec_is_refused(tmp_path, change, message):
    rank0 = ShardWriter(tmp_path, make_spec(), rank=0, world_size=2)
    with pytest.raises(SpecMismatch, match=message):
        ShardWriter(tmp_path, make_spec(**{"dtype": "float32", **change}), rank=1, world_size=2)
    assert not (tmp_path / "rank-00001.lock").exists()
    rank0.close()


def test_rank_zero_cannot_overwrite_while_another_rank_writes(tmp_path):
    ids, rows = make_rows(4)
    with ShardWriter(tmp_path, make_spec(), rank=0, world_size=2) as rank0:
        rank0.put(ids, rows)
    rank1 = ShardWriter(tmp_path, make_spec(), rank=1, world_size=2)
    with pytest.raises(StoreError, match=r"cannot overwrite .* pid \d+ .*rank-00001.lock"):
        ShardWriter(tmp_path, make_spec(), StoreOptions(overwrite=True), rank=0, world_size=2)
    rank1.close()
    with ShardWriter(tmp_path, make_spec(), StoreOptions(overwrite=True), rank=0, world_size=2) as rank0:
        rank0.put(ids[:2], rows[:2])
    with ShardWriter(tmp_path, make_spec(), StoreOptions(overwrite=True), rank=1, world_size=2) as rank1:
        rank1.put(ids[2:], rows[2:])
    store = GradientStore.open(tmp_path)
    assert store.ids == ids and torch.equal(store.read(0, 4), rows)


def test_rank_outside_world_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        ShardWriter(tmp_path, make_spec(), rank=2, world_size=2)
