"""Vectors written through ShardWriter come back as written (fp32), within bf16 rounding, within the int8 bound."""

import json

import pytest
import torch

from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter
from tests.store.common import DIM, PARAMS, make_rows, make_spec, status, write

CHUNKS = [3, 7, 1, 12]  # 23 rows in shards of 5: 5, 5, 5, 5 and a partial 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_round_trip(tmp_path, dtype):
    ids, rows = make_rows(23)
    steps = [i // 4 for i in range(23)]
    write(tmp_path, ids, rows, chunks=CHUNKS, dtype=dtype, fields={"step": steps})
    store = GradientStore.open(tmp_path)
    assert [s.rows for s in store.shards] == [5, 5, 5, 5, 3]
    assert [s.start for s in store.shards] == [0, 5, 10, 15, 20]
    assert store.ids == ids
    assert store.field("step") == steps
    assert store.complete and len(store) == 23 and store.dim == DIM
    got = store.read(0, len(store))
    assert got.dtype == torch.float32 and got.shape == (23, DIM)
    if dtype == "float32":
        assert torch.equal(got, rows)
    elif dtype == "bfloat16":
        assert torch.equal(got, rows.to(torch.bfloat16).float())
        assert ((got - rows).abs() <= rows.abs() * 2.0**-8).all()  # round to nearest, 8 significant bits
    else:
        bound = rows.abs().amax(dim=1, keepdim=True) / 254  # half a quantization step per row
        assert ((got - rows).abs() <= bound * (1 + 1e-5)).all()
        assert not torch.equal(got, rows)
    info = store.info()
    assert info["rows"] == 23 and info["shards"] == 5 and info["dtype"] == dtype and info["ranks"] == {0: "complete"}
    raw = {"float32": 4, "bfloat16": 2, "int8": 1}[dtype] * DIM * 23 + (4 * 23 if dtype == "int8" else 0)
    assert info["bytes"] == raw


@pytest.mark.parametrize("block", [1, 4, 5, 7, 10, 23, 100])
def test_iter_blocks_covers_rows_in_order(tmp_path, block):
    ids, rows = make_rows(23)
    write(tmp_path, ids, rows, chunks=CHUNKS)
    store = GradientStore.open(tmp_path)
    blocks = list(store.iter_blocks(block))
    assert [start for start, _ in blocks] == list(range(0, 23, block))
    assert all(b.shape[0] == min(block, 23 - start) for start, b in blocks)
    assert torch.equal(torch.cat([b for _, b in blocks]), rows)


def test_read_ranges_rows_and_index_of(tmp_path):
    ids, rows = make_rows(23)
    write(tmp_path, ids, rows, chunks=CHUNKS, dtype="int8")
    store = GradientStore.open(tmp_path)
    full = store.read(0, 23)
    assert torch.equal(store.read(4, 11), full[4:11])  # across two shard boundaries
    assert torch.equal(store.read(-3, 2), full[:2])
    assert store.read(30, 40).shape == (0, DIM)
    index = [22, 0, 5, 5, 14, 3]  # any order, repeats, several shards
    assert torch.equal(store.rows(index), full[index])
    assert store.rows([]).shape == (0, DIM)
    assert store.index_of([ids[17], ids[2]]) == [17, 2]
    with pytest.raises(KeyError, match="nope"):
        store.index_of(["nope"])
    with pytest.raises(IndexError, match="row 23 is out of range"):
        store.rows([1, 23])


def test_put_copies_rows_and_skips_ids_already_written(tmp_path):
    ids, rows = make_rows(8)
    writer = ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=3))
    buffer = rows[:4].clone()
    writer.put(ids[:4], buffer)
    buffer.fill_(7.0)  # a caller reusing its buffer must not change what is written
    writer.put(ids[2:8], rows[2:8])  # ids 2, 3 were put already
    writer.put([ids[5], ids[5]], rows[:2])
    writer.close()
    store = GradientStore.open(tmp_path)
    assert store.ids == ids
    assert torch.equal(store.read(0, 8), rows)
    assert status(tmp_path)["skipped"] == {"nonfinite": [], "already_stored": 0, "duplicate": 4}
    assert status(tmp_path)["rows"] == 8 and status(tmp_path)["shards"] == 3


def test_manifest_describes_the_store(tmp_path):
    ids, rows = make_rows(4)
    write(tmp_path, ids, rows, dtype="bfloat16", config={"run": "unit"})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format"] == "gradtrace-store" and manifest["schema_version"] == 2
    assert manifest["spec"]["params"] == [[n, d] for n, d in PARAMS]
    assert manifest["spec"]["dtype"] == "bfloat16"
    assert manifest["shard_rows"] == 5 and manifest["world_size"] == 1 and manifest["config"] == {"run": "unit"}
    record = json.loads((tmp_path / "shards" / "r00000-000000.json").read_text())
    assert record["rows"] == 4 and record["ids"] == ids and record["files"]["data"]["bytes"] == 4 * DIM * 2
    assert GradientStore.open(tmp_path).spec == make_spec("bfloat16")


def test_writer_as_context_manager_and_put_validation(tmp_path):
    ids, rows = make_rows(3)
    with ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=2)) as writer:
        with pytest.raises(ValueError, match=r"expected \[3, 14\] vectors"):
            writer.put(ids, rows[:, :5])
        with pytest.raises(ValueError, match="field 'step' has 2 values for 3 rows"):
            writer.put(ids, rows, {"step": [0, 1]})
        with pytest.raises(ValueError, match="JSON"):
            writer.put(ids, rows, {"obj": [object()] * 3})
        writer.put(ids, rows, {"step": torch.tensor([4, 5, 6])})
    with pytest.raises(Exception, match="closed"):
        writer.put(ids, rows)
    writer.close()  # a second close does nothing
    store = GradientStore.open(tmp_path)
    assert torch.equal(store.read(0, 3), rows) and store.field("step") == [4, 5, 6]
    assert not (tmp_path / "rank-00000.lock").exists()
