"""Rows are written as they come, into shards sized in bytes: memory holds the queued batches, never a shard."""

import json
import time

import pytest
import torch

from gradtrace.grad.quantize import quantize
from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter
from gradtrace.store.shards import DEFAULT_MAX_SHARD_ROWS, DEFAULT_SHARD_BYTES, row_bytes, rows_per_shard
from tests.store.common import DIM, make_rows, make_spec, write

INT8_ROW = DIM + 4  # int8 values and one float32 scale


def test_row_bytes_counts_values_and_the_int8_scale():
    assert row_bytes(DIM, "float32") == 4 * DIM and row_bytes(DIM, "bfloat16") == 2 * DIM
    assert row_bytes(DIM, "int8") == INT8_ROW


def test_default_shard_is_256_mib_of_rows_at_most_65536_rows(tmp_path):
    assert DEFAULT_SHARD_BYTES == 256 * 2**20 and DEFAULT_MAX_SHARD_ROWS == 65536
    assert rows_per_shard(109_696, "int8") == DEFAULT_SHARD_BYTES // (109_696 + 4) == 2446  # the rows
    assert rows_per_shard(128, "float32") == 65536  # 512 B rows: the record's ids cap the shard, not its bytes
    write(tmp_path, *make_rows(3), dtype="int8", shard_rows=None)
    assert json.loads((tmp_path / "manifest.json").read_text())["shard_rows"] == 65536


def test_shard_bytes_sets_the_rows_per_shard_and_the_bytes_match_a_store_by_rows(tmp_path):
    ids, rows = make_rows(10)
    write(tmp_path / "bytes", ids, rows, chunks=[3, 3, 4], dtype="int8", shard_rows=None,
          shard_bytes=4 * INT8_ROW + INT8_ROW - 1)  # 4 rows fit, not 5
    write(tmp_path / "rows", ids, rows, chunks=[10], dtype="int8", shard_rows=4)
    by_bytes, by_rows = GradientStore.open(tmp_path / "bytes"), GradientStore.open(tmp_path / "rows")
    assert [s.rows for s in by_bytes.shards] == [4, 4, 2] == [s.rows for s in by_rows.shards]
    for shard in by_bytes.shards:  # a shard appended batch by batch holds the bytes of one written at once
        for suffix in (".data", ".scale"):
            got = (tmp_path / "bytes" / "shards" / f"{shard.name}{suffix}").read_bytes()
            assert got == (tmp_path / "rows" / "shards" / f"{shard.name}{suffix}").read_bytes()
    assert (tmp_path / "bytes" / "shards" / "r00000-000000.data").stat().st_size == 4 * DIM
    q = quantize(rows, "int8")
    assert torch.equal(by_bytes.read(0, 10), q.dequantize())


def test_shard_bytes_smaller_than_one_row_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"shard_bytes=17 is smaller than one row \(18 bytes: 14 values in int8\)"):
        ShardWriter(tmp_path / "store", make_spec("int8"), StoreOptions(shard_bytes=INT8_ROW - 1))
    assert not (tmp_path / "store").exists()
    with pytest.raises(ValueError, match="shard_rows or shard_bytes, not both"):
        ShardWriter(tmp_path / "store", make_spec(), StoreOptions(shard_rows=4, shard_bytes=4096))


def test_rows_reach_the_open_shard_file_before_the_shard_is_full(tmp_path):
    ids, rows = make_rows(7)
    writer = ShardWriter(tmp_path, make_spec())  # default: a 256 MiB shard, far from full
    writer.put(ids[:3], rows[:3])
    writer.put(ids[3:], rows[3:])
    partial = tmp_path / "shards" / ".tmp-r00000-000000.data"
    deadline = time.monotonic() + 20
    while not (partial.exists() and partial.stat().st_size == 7 * 4 * DIM) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert partial.stat().st_size == 7 * 4 * DIM  # on disk, not held in memory
    assert not (tmp_path / "shards" / "r00000-000000.json").exists()  # not committed yet
    writer.close()
    store = GradientStore.open(tmp_path)
    assert store.ids == ids and torch.equal(store.read(0, 7), rows)
    assert not partial.exists()
