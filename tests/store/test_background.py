"""The background writer: a full disk mid-write, and puts that do not wait for the disk."""

import errno
import threading
import time

import pytest
import torch

import gradtrace.store.shards as writer_module
from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter, StoreError, StoreWriteError
from tests.store.common import make_rows, make_spec, status


def test_disk_full_mid_write_keeps_committed_shards_and_resumes(tmp_path, monkeypatch):
    ids, rows = make_rows(20)
    real_append = writer_module._OpenShard.append
    calls = []

    def fill_disk_after_two_shards(shard, part, values):
        calls.append(shard.name)
        if len(calls) > 4:  # the third shard's first rows (2 rows a put, 4 a shard): the disk is full
            shard.files[part].write(b"partial")  # what a failed write leaves in the temporary file
            raise OSError(errno.ENOSPC, "No space left on device", str(shard.tmp[part]))
        real_append(shard, part, values)

    monkeypatch.setattr(writer_module._OpenShard, "append", fill_disk_after_two_shards)
    writer = ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=4, queue_size=2))
    with pytest.raises(StoreWriteError) as err:
        for start in range(0, 20, 2):
            writer.put(ids[start:start + 2], rows[start:start + 2])
            time.sleep(0.01)
        writer.close()
    message = str(err.value)
    assert "No space left on device" in message
    assert "8 rows of rank 0 are committed (2 shards) and readable" in message and "resume=True" in message
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(StoreWriteError, match="8 rows of rank 0 are committed"):
        writer.close()  # the first close after the failure reports it too (a put may have raised first)
    writer.close()

    assert status(tmp_path)["status"] == "failed" and "No space left" in status(tmp_path)["error"]
    with pytest.raises(StoreError, match=r"incomplete \(rank 0: failed\).*8 committed rows"):
        GradientStore.open(tmp_path)
    partial = GradientStore.open(tmp_path, allow_incomplete=True)
    assert partial.ids == ids[:8] and torch.equal(partial.read(0, 8), rows[:8])
    assert not (tmp_path / "rank-00000.lock").exists()
    assert not list((tmp_path / "shards").glob(".tmp-*"))  # the failed shard's temporary file is removed

    monkeypatch.setattr(writer_module._OpenShard, "append", real_append)  # space was freed
    with ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=4, resume=True)) as resumed:
        resumed.put(ids, rows)
    store = GradientStore.open(tmp_path)
    assert store.ids == ids and torch.equal(store.read(0, 20), rows)
    assert not list((tmp_path / "shards").glob(".tmp-*"))


def test_put_does_not_wait_for_a_slow_disk_until_the_queue_is_full(tmp_path, monkeypatch):
    real_append = writer_module._OpenShard.append
    started, release = threading.Event(), threading.Event()

    def slow_append(shard, part, values):
        started.set()
        release.wait(timeout=30)
        real_append(shard, part, values)

    monkeypatch.setattr(writer_module._OpenShard, "append", slow_append)
    safety = threading.Timer(20, release.set)  # never hang the suite
    safety.start()
    try:
        ids, rows = make_rows(10)
        writer = ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=2, queue_size=2))
        writer.put(ids[0:2], rows[0:2])  # the thread takes it and blocks in the write
        assert started.wait(timeout=10)
        tic = time.monotonic()
        writer.put(ids[2:4], rows[2:4])  # queued
        writer.put(ids[4:6], rows[4:6])  # queued: the queue is now full
        assert time.monotonic() - tic < 1.0 and not release.is_set()

        fourth = threading.Thread(target=writer.put, args=(ids[6:8], rows[6:8]))
        fourth.start()
        fourth.join(timeout=0.3)
        assert fourth.is_alive(), "put() must block while the queue is full"
        release.set()
        fourth.join(timeout=10)
        assert not fourth.is_alive()
        writer.put(ids[8:], rows[8:])
        writer.close()
    finally:
        release.set()
        safety.cancel()
    store = GradientStore.open(tmp_path)
    assert store.ids == ids and torch.equal(store.read(0, 10), rows)
