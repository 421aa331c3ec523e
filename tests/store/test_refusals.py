"""Damaged, foreign, incompatible or busy stores are refused with a message that says what is wrong."""

import json
import os
import socket

import pytest

from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter, SpecMismatch, StoreError
from tests.store.common import MODEL, PROJECTION, make_rows, make_spec, write


@pytest.fixture
def store_path(tmp_path):
    ids, rows = make_rows(12)
    write(tmp_path / "store", ids, rows, dtype="int8", shard_rows=5)  # shards of 5, 5, 2
    return tmp_path / "store"


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_truncated_shard_is_named(store_path):
    data = store_path / "shards" / "r00000-000001.data"
    data.write_bytes(data.read_bytes()[:-3])
    with pytest.raises(StoreError, match=r"shard r00000-000001: r00000-000001.data is truncated"):
        GradientStore.open(store_path)
    with pytest.raises(StoreError, match="truncated"):
        GradientStore.open(store_path, verify=False, allow_incomplete=True)


@pytest.mark.parametrize("suffix", ["data", "scale"])
def test_flipped_byte_fails_the_checksum(store_path, suffix):
    file = store_path / "shards" / f"r00000-000002.{suffix}"
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    file.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=rf"shard r00000-000002: r00000-000002.{suffix} is corrupted \(checksum"):
        GradientStore.open(store_path)
    assert len(GradientStore.open(store_path, verify=False)) == 12  # only the checksum notices


def test_missing_files(store_path):
    (store_path / "shards" / "r00000-000000.scale").unlink()
    with pytest.raises(StoreError, match=r"shard r00000-000000: r00000-000000.scale is missing"):
        GradientStore.open(store_path)
    (store_path / "manifest.json").unlink()
    with pytest.raises(StoreError, match=r"is not a gradient store \(no manifest.json\)"):
        GradientStore.open(store_path)


def test_corrupted_records_and_status_files(store_path):
    (store_path / "shards" / "r00000-000001.json").write_text('{"name": "r00000-000001", "rows"')
    with pytest.raises(StoreError, match=r"shard record r00000-000001.json is corrupted"):
        GradientStore.open(store_path)
    with pytest.raises(StoreError, match=r"shard record r00000-000001.json .* is corrupted"):
        ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True))
    assert not (store_path / "rank-00000.lock").exists()  # a refused writer leaves no lock behind


def test_corrupted_manifest(store_path):
    (store_path / "manifest.json").write_text('{"format": "gradtrace-store", "schema_')
    with pytest.raises(StoreError, match=r"manifest.json is corrupted"):
        GradientStore.open(store_path)
    with pytest.raises(StoreError, match=r"corrupted.*overwrite=True"):
        ShardWriter(store_path, make_spec(), StoreOptions(resume=True))
    ids, rows = make_rows(3, seed=9)
    write(store_path, ids, rows, overwrite=True)  # a store with a broken manifest can still be replaced
    assert GradientStore.open(store_path).ids == ids


def test_wrong_schema_version(store_path):
    manifest = _manifest(store_path)
    manifest["schema_version"] = 99
    (store_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="schema version 99, this gradtrace reads version 1"):
        GradientStore.open(store_path)
    with pytest.raises(StoreError, match="schema version 99"):
        ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True))


@pytest.mark.parametrize("change, message", [
    ({"model": {**MODEL, "arch": "ffffffffffffffff", "class": "Other"}}, "made by another model"),
    ({"projection": {**PROJECTION, "seed": 4}}, "different projections"),
    ({"projection": None}, "different projections"),
    ({"convention": {"reduction": "mean", "example_loss": "mean"}}, "different loss conventions"),
    ({"params": [("fc1.weight", 6), ("fc1.bias", 3)]}, "different captured parameters"),
    ({"params": [("fc1.weight", 6), ("fc1.bias", 4), ("head.weight", 5)]}, "different dimensions"),
    ({"dtype": "bfloat16"}, "stores int8, this run writes bfloat16"),
])
def test_resume_with_an_incompatible_spec(store_path, change, message):
    spec = make_spec(**{"dtype": "int8", **change})
    with pytest.raises(SpecMismatch, match=message):
        ShardWriter(store_path, spec, StoreOptions(resume=True))
    assert not (store_path / "rank-00000.lock").exists()
    assert len(GradientStore.open(store_path)) == 12  # untouched


def test_resume_with_other_weights_of_the_same_model_is_refused(store_path):
    spec = make_spec("int8", model={**MODEL, "weights": "9999999999999999"})
    with pytest.raises(SpecMismatch, match=r"collected with other model weights \(fingerprint 0011223344556677, "
                                           r"this model's is 9999999999999999\).*overwrite=True"):
        ShardWriter(store_path, spec, StoreOptions(resume=True))
    assert not (store_path / "rank-00000.lock").exists()
    assert len(GradientStore.open(store_path)) == 12  # untouched
    ids, rows = make_rows(2, seed=8)
    # a store written during training admits other weights (the Trainer callback passes mixed_weights)
    with ShardWriter(store_path, spec, StoreOptions(resume=True), mixed_weights=True) as writer:
        writer.put(ids, rows)
    assert len(GradientStore.open(store_path)) == 14


def test_non_store_directories(tmp_path):
    with pytest.raises(StoreError, match="no such directory"):
        GradientStore.open(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"is not a gradient store \(no manifest.json\)"):
        GradientStore.open(tmp_path)
    with pytest.raises(StoreError, match=r"is not empty and is not a gradient store .*notes.txt"):
        ShardWriter(tmp_path, make_spec())
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(StoreError, match="not a gradtrace store"):
        GradientStore.open(tmp_path)
    with pytest.raises(StoreError, match="not a gradtrace store"):
        ShardWriter(tmp_path, make_spec(), StoreOptions(overwrite=True))
    assert (tmp_path / "notes.txt").read_text() == "mine"  # overwrite never deletes what is not a store
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match="not a gradtrace store"):
        GradientStore.open(tmp_path)


def test_existing_store_needs_resume_or_overwrite(store_path):
    with pytest.raises(StoreError, match=r"already holds a store; pass resume=True .* or overwrite=True"):
        ShardWriter(store_path, make_spec("int8"))
    with pytest.raises(ValueError, match="contradict"):
        ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True, overwrite=True))
    ids, rows = make_rows(3, seed=5)
    write(store_path, ids, rows, dtype="float32", overwrite=True)  # another dtype, even: it is a new store
    store = GradientStore.open(store_path)
    assert store.ids == ids and store.spec.dtype == "float32" and len(store.shards) == 1
    assert sorted(p.name for p in (store_path / "shards").iterdir()) == ["r00000-000000.data", "r00000-000000.json"]


def test_second_writer_on_the_same_rank_is_refused(store_path):
    first = ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True))
    try:
        with pytest.raises(StoreError, match=rf"being written by another run \(pid {os.getpid()} on"):
            ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True))
        with pytest.raises(StoreError, match=rf"pid {os.getpid()}"):
            ShardWriter(store_path, make_spec("int8"), StoreOptions(overwrite=True))
        assert len(GradientStore.open(store_path, allow_incomplete=True)) == 12
    finally:
        first.close()
    # free again once the first one closed
    ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True)).close()


def test_lock_of_a_live_process_is_respected(store_path):
    other = os.getppid()  # alive, and not us
    lock = store_path / "rank-00000.lock"
    lock.write_text(json.dumps({"pid": other, "host": socket.gethostname()}))
    with pytest.raises(StoreError, match=rf"pid {other} on {socket.gethostname()}.*delete .*rank-00000.lock"):
        ShardWriter(store_path, make_spec("int8"), StoreOptions(resume=True))
    with pytest.raises(StoreError, match=rf"being written by another run \(pid {other}"):
        ShardWriter(store_path, make_spec("int8"), StoreOptions(overwrite=True))
    assert lock.exists() and str(other) in lock.read_text()
    (store_path / "rank-00000.json").write_text('{"status": "writing"}')
    with pytest.raises(StoreError, match=rf"rank 0: writing, writer pid {other} on .* still holds the lock"):
        GradientStore.open(store_path)


def test_reader_writer_and_delete_share_one_manifest_check(tmp_path, store_path):
    """store.manifest.check_manifest is the one format/schema/checksum rule: opening, writing to and deleting a
    store refuse the same manifests with the same words, each naming what to do."""
    from gradtrace.store.manifest import check_manifest
    from gradtrace.store.writer import delete_store

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"format": "something-else"}')
    message = r"is not a gradtrace store \(manifest.json has format 'something-else'\)"
    for refuse in (lambda: GradientStore.open(foreign),
                   lambda: ShardWriter(foreign, make_spec(), StoreOptions(resume=True)),
                   lambda: ShardWriter(foreign, make_spec(), StoreOptions(overwrite=True)),
                   lambda: delete_store(foreign)):
        with pytest.raises(StoreError, match=message):
            refuse()
    assert (foreign / "manifest.json").exists()
    manifest = _manifest(store_path)
    assert check_manifest(store_path, manifest, "read") == manifest == check_manifest(store_path, manifest, "write")
    edited = {**manifest, "shard_rows": 7}
    with pytest.raises(StoreError, match=r"was edited or is corrupted .*Restore the original file"):
        check_manifest(store_path, edited, "read")
    with pytest.raises(StoreError, match=r"was edited or is corrupted .*pass overwrite=True"):
        check_manifest(store_path, edited, "write")
    assert check_manifest(store_path, edited, "write", format_only=True) is edited  # may be replaced
    with pytest.raises(StoreError, match=r"schema version 1 \(an older gradtrace's store: readable, but not "
                                         r"resumable\), this gradtrace writes version 2; write to a new directory"):
        check_manifest(store_path, {**manifest, "schema_version": 1}, "write")
    assert check_manifest(store_path, {**manifest, "schema_version": 1}, "read")["schema_version"] == 1
