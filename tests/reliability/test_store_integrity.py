"""Fault injection into a gradient store: every corruption is refused with a message naming it, and nothing
previously written is lost (the untouched files stay byte-identical; undoing the damage gives the store back)."""

from __future__ import annotations

import errno
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gradtrace
from gradtrace.cli.inspect import describe
from gradtrace.cli.main import app
from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter, StoreError, StoreWriteError
from gradtrace.store import writer as writer_module
from gradtrace.store.artifact import checksum
from gradtrace.store.layout import manifest_checksum
from tests import tiny

NUM, SHARD_ROWS = 10, 4  # shards r00000-000000..2 of 4, 4, 2 rows


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(NUM, 7, generator=gen), torch.randint(0, 4, (NUM,), generator=gen)
    return [(x[i:i + 3], y[i:i + 3]) for i in range(0, NUM, 3)]


def _collect(path: Path, resume: bool = False) -> GradientStore:
    torch.manual_seed(0)
    return gradtrace.collect(tiny.MLP(), _batches(), store=path,
                             options=gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                             store_options=gradtrace.StoreOptions(shard_rows=SHARD_ROWS, resume=resume),
                             run=gradtrace.RunOptions(ids=[f"ex{i}" for i in range(NUM)]))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "store"
    store = _collect(path)
    assert [s.rows for s in store.shards] == [4, 4, 2]
    return path


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "store"))


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _shard(store: Path, seq: int, kind: str) -> Path:
    return store / "shards" / f"r00000-{seq:06d}.{kind}"


def _assert_nothing_lost(store: Path, before: dict[str, bytes], damaged: set[str], pristine: Path) -> None:
    """The refusal changed nothing but the damaged files; restoring them gives the original store back."""
    after = _files(store)
    for name, data in before.items():
        if name not in damaged:
            assert after.get(name) == data, f"{name} changed"
    for name in damaged:
        (store / name).unlink(missing_ok=True)
        if name in before:
            (store / name).write_bytes(before[name])
    original = GradientStore.open(pristine)
    restored = GradientStore.open(store)
    assert restored.ids == original.ids and torch.equal(restored.read(0, NUM), original.read(0, NUM))


def test_pristine_store_lists_every_shard_with_its_record_checksum(pristine):
    status = _json(pristine / "rank-00000.json")
    assert status["status"] == "complete" and status["rows"] == NUM and status["shards"] == 3
    assert [e["name"] for e in status["committed"]] == [f"r00000-{s:06d}" for s in range(3)]
    assert [e["rows"] for e in status["committed"]] == [4, 4, 2]
    for seq, entry in enumerate(status["committed"]):
        assert entry["record"] == checksum(_shard(pristine, seq, "json").read_bytes())
    manifest = _json(pristine / "manifest.json")
    assert manifest["schema_version"] == 2 and manifest["checksum"] == manifest_checksum(manifest)
    assert describe(pristine, verify=True)["checked"][-1] == "data checksums"


def test_deleted_shard_is_named(store, pristine):
    before = _files(store)
    _shard(store, 1, "data").unlink()
    _shard(store, 1, "json").unlink()
    message = r"shard r00000-000001 is missing: rank-00000.json lists it \(4 rows\) but shards/r00000-000001.json"
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store)
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store, verify=False, allow_incomplete=True)
    with pytest.raises(StoreError, match=message):
        ShardWriter(store, GradientStore.open(pristine).spec, StoreOptions(resume=True))
    assert not (store / "rank-00000.lock").exists()
    _assert_nothing_lost(store, before, {"shards/r00000-000001.data", "shards/r00000-000001.json"}, pristine)


def _copy_shard(store: Path, seq: int, new_seq: int, *, rename_inside: bool) -> set[str]:
    old, new = f"r00000-{seq:06d}", f"r00000-{new_seq:06d}"
    shutil.copy(_shard(store, seq, "data"), _shard(store, new_seq, "data"))
    record = _json(_shard(store, seq, "json"))
    if rename_inside:  # a careful copy: the record says what its file name says
        record.update(name=new, seq=new_seq)
        record["files"]["data"]["name"] = f"{new}.data"
    _shard(store, new_seq, "json").write_text(json.dumps(record, indent=1))
    assert old != new
    return {f"shards/{new}.data", f"shards/{new}.json"}


def test_duplicated_shard_under_a_new_seq_is_refused(store, pristine):
    before = _files(store)
    added = _copy_shard(store, 1, 3, rename_inside=True)
    with pytest.raises(StoreError, match=r"shard record r00000-000003.json is not listed in rank-00000.json, which "
                                         r"says rank 0 finished: a copied or foreign shard"):
        GradientStore.open(store)
    with pytest.raises(StoreError, match="not listed"):
        describe(store, verify=True)  # gradtrace inspect --verify
    _assert_nothing_lost(store, before, added, pristine)


def test_duplicated_shard_in_an_unfinished_store_is_refused_by_its_ids(store, pristine):
    status = _json(store / "rank-00000.json")
    (store / "rank-00000.json").write_text(json.dumps({**status, "status": "interrupted"}))
    before = _files(store)
    added = _copy_shard(store, 1, 3, rename_inside=True)
    with pytest.raises(StoreError, match=r"id 'ex4' is stored twice \(shards r00000-000001 and r00000-000003\)"):
        GradientStore.open(store, allow_incomplete=True)
    for name in added:
        (store / name).unlink()
    assert _files(store) == before


def test_copied_record_under_another_name_is_refused(store, pristine):
    before = _files(store)
    added = _copy_shard(store, 1, 3, rename_inside=False)
    with pytest.raises(StoreError, match=r"shard record r00000-000003.json is not listed"):
        GradientStore.open(store)
    status = _json(store / "rank-00000.json")  # an unfinished rank, whose next record would be adopted
    (store / "rank-00000.json").write_text(json.dumps({**status, "status": "interrupted"}))
    with pytest.raises(StoreError, match=r"shard record r00000-000003.json describes shard 'r00000-000001'"):
        GradientStore.open(store, allow_incomplete=True)
    (store / "rank-00000.json").write_bytes(before["rank-00000.json"])
    _assert_nothing_lost(store, before, added, pristine)


def test_gap_in_the_shard_numbers_is_refused(store, pristine):
    status = _json(store / "rank-00000.json")
    (store / "rank-00000.json").write_text(json.dumps({**status, "status": "writing", "committed": [],
                                                       "rows": 0, "shards": 0}))
    before = _files(store)
    _shard(store, 1, "json").unlink()
    with pytest.raises(StoreError, match=r"shard r00000-000001 is missing: shards/ holds r00000-000002.json but not"):
        GradientStore.open(store, allow_incomplete=True)
    (store / "shards" / "r00000-000001.json").write_bytes(before["shards/r00000-000001.json"])
    assert len(GradientStore.open(store, allow_incomplete=True)) == NUM  # all three records adopted


def test_reversed_ids_in_a_record_fail_its_checksum(store, pristine):
    before = _files(store)
    path = _shard(store, 0, "json")
    record = _json(path)
    record["ids"] = record["ids"][::-1]
    path.write_text(json.dumps(record, indent=1))
    message = (r"shard record r00000-000000.json does not match its checksum in rank-00000.json: it was edited or is "
               r"corrupted")
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store)
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store, verify=False, allow_incomplete=True)
    _assert_nothing_lost(store, before, {"shards/r00000-000000.json"}, pristine)


@pytest.mark.parametrize("consistent", [False, True], ids=["record-only", "checksum-updated"])
def test_record_naming_a_file_outside_the_store_is_refused(store, pristine, tmp_path, consistent):
    other = Path(shutil.copytree(pristine, tmp_path / "other"))  # a file that exists and has the right size
    before = _files(store)
    path = _shard(store, 0, "json")
    record = _json(path)
    record["files"]["data"]["name"] = "../../other/shards/r00000-000000.data"
    path.write_text(json.dumps(record, indent=1))
    assert (store / "shards" / record["files"]["data"]["name"]).exists()
    damaged = {"shards/r00000-000000.json"}
    if consistent:  # someone (or some tool) also updated the list: the name itself is refused
        status = _json(store / "rank-00000.json")
        status["committed"][0]["record"] = checksum(path.read_bytes())
        (store / "rank-00000.json").write_text(json.dumps(status, indent=1))
        damaged.add("rank-00000.json")
        message = (r"shard r00000-000000: its record names '../../other/shards/r00000-000000.data' as its data file; "
                   r"a record may only name its own files")
    else:
        message = r"shard record r00000-000000.json does not match its checksum"
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store)
    with pytest.raises(StoreError, match=message):
        describe(store, verify=True)
    _assert_nothing_lost(store, before, damaged, pristine)
    assert other.exists()


@pytest.mark.parametrize("name", ["foo.json", "rfoo.json", "r00000-000000.json.bak", "notes.txt"])
def test_stray_file_in_shards_is_ignored_with_a_warning(store, pristine, name):
    (store / "shards" / name).write_text('{"hello": 1}')
    with pytest.warns(UserWarning, match=rf"1 file\(s\) that are no part of the store, ignored: \['{name}'\]"):
        opened = GradientStore.open(store)
    original = GradientStore.open(pristine)
    assert opened.ids == original.ids and torch.equal(opened.read(0, NUM), original.read(0, NUM))
    with pytest.warns(UserWarning, match="no part of the store"):
        ShardWriter(store, original.spec, StoreOptions(resume=True)).close()  # a resumed writer is not stopped either
    with pytest.warns(UserWarning, match="no part of the store"):
        assert GradientStore.open(store).ids == original.ids


@pytest.mark.parametrize("edit", ["seed", "dtype", "param_dim", "world_size"])
def test_edited_manifest_is_refused(store, pristine, edit):
    before = _files(store)
    manifest = _json(store / "manifest.json")
    if edit == "seed":
        manifest["spec"]["projection"]["seed"] += 1
    elif edit == "dtype":
        manifest["spec"]["dtype"] = "bfloat16"
    elif edit == "param_dim":
        manifest["spec"]["params"][0][1] += 1
    else:
        manifest["world_size"] = 2
    (store / "manifest.json").write_text(json.dumps(manifest, indent=1))
    message = r"manifest.json was edited or is corrupted \(its checksum does not match its content"
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store)
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store, verify=False, allow_incomplete=True)
    with pytest.raises(StoreError, match=r"manifest.json was edited or is corrupted .* overwrite=True"):
        ShardWriter(store, GradientStore.open(pristine).spec, StoreOptions(resume=True))
    _assert_nothing_lost(store, before, {"manifest.json"}, pristine)


def test_config_of_the_manifest_is_provenance_and_may_be_updated(store, pristine):
    """The Trainer integration adds the checkpoints it saves to ``config``; the checksum leaves it out."""
    manifest = _json(store / "manifest.json")
    manifest["config"]["trainer"] = {"checkpoints": [{"step": 3, "path": "checkpoint-3"}]}
    (store / "manifest.json").write_text(json.dumps(manifest, indent=1))
    assert GradientStore.open(store).manifest["config"]["trainer"]["checkpoints"][0]["step"] == 3


def test_truncated_data_is_named(store, pristine):
    before = _files(store)
    data = _shard(store, 2, "data")
    data.write_bytes(data.read_bytes()[:-5])
    message = r"shard r00000-000002: r00000-000002.data is truncated or damaged"
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store, verify=False, allow_incomplete=True)
    with pytest.raises(StoreError, match=message):
        describe(store)
    _assert_nothing_lost(store, before, {"shards/r00000-000002.data"}, pristine)


def test_flipped_data_byte_fails_verify(store, pristine):
    before = _files(store)
    data = _shard(store, 1, "data")
    raw = bytearray(data.read_bytes())
    raw[13] ^= 0x01
    data.write_bytes(bytes(raw))
    assert len(GradientStore.open(store, verify=False)) == NUM  # only the data checksum can notice
    assert describe(store)["checksums_verified"] is False
    message = r"shard r00000-000001: r00000-000001.data is corrupted \(checksum mismatch\)"
    with pytest.raises(StoreError, match=message):
        GradientStore.open(store)
    result = CliRunner().invoke(app, ["inspect", str(store), "--verify"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Error: shard r00000-000001: r00000-000001.data is corrupted (checksum mismatch)" in result.output
    _assert_nothing_lost(store, before, {"shards/r00000-000001.data"}, pristine)


def test_record_committed_but_not_listed_is_adopted_on_resume(store, pristine):
    """A writer killed between a shard's record and its rank file update: the record is the next one in
    sequence, read by allow_incomplete and adopted (listed) by the resuming writer."""
    status = _json(store / "rank-00000.json")
    last = status["committed"].pop()
    (store / "rank-00000.json").write_text(json.dumps(
        {**status, "status": "writing", "rows": status["rows"] - last["rows"], "shards": 2}))
    with pytest.raises(StoreError, match=r"incomplete \(rank 0: writing\)"):
        GradientStore.open(store)
    original = GradientStore.open(pristine)
    partial = GradientStore.open(store, allow_incomplete=True)
    assert partial.ids == original.ids and [s.listed for s in partial.shards] == [True, True, False]
    ShardWriter(store, original.spec, StoreOptions(resume=True)).close()
    assert _json(store / "rank-00000.json")["committed"] == _json(pristine / "rank-00000.json")["committed"]
    assert torch.equal(GradientStore.open(store).read(0, NUM), original.read(0, NUM))


def test_schema_1_stores_are_read_with_the_checks_they_allow(store, pristine):
    """A store as gradtrace wrote it before schema 2: no manifest checksum, no shard list."""
    manifest = _json(store / "manifest.json")
    manifest.pop("checksum")
    (store / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 1}, indent=1))
    status = _json(store / "rank-00000.json")
    status.pop("committed")
    (store / "rank-00000.json").write_text(json.dumps(status, indent=1))
    original = GradientStore.open(pristine)
    old = GradientStore.open(store)
    assert old.ids == original.ids and torch.equal(old.read(0, NUM), original.read(0, NUM))
    assert describe(store)["checked"][0] == "shard and row counts of finished ranks"
    with pytest.raises(StoreError, match=r"schema version 1 \(an older gradtrace's store: readable, but not "
                                         r"resumable\), this gradtrace writes version 2"):
        ShardWriter(store, original.spec, StoreOptions(resume=True))
    before = _files(store)
    _shard(store, 2, "json").unlink()
    with pytest.raises(StoreError, match=r"lost or gained shards: rank-00000.json says rank 0 committed 3 shards, "
                                         r"shards/ holds 2"):
        GradientStore.open(store)
    _assert_nothing_lost(store, before, {"shards/r00000-000002.json"}, pristine)
    record = _json(_shard(store, 0, "json"))
    record["files"]["data"]["name"] = "../../elsewhere.data"
    _shard(store, 0, "json").write_text(json.dumps(record))
    with pytest.raises(StoreError, match="a record may only name its own files"):
        GradientStore.open(store)


def test_unknown_schema_version_names_both(store):
    manifest = _json(store / "manifest.json")
    manifest["schema_version"] = 3
    manifest["checksum"] = manifest_checksum(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"schema version 3, this gradtrace reads version 1 or 2"):
        GradientStore.open(store)


def test_disk_full_at_the_final_status_write_is_a_store_write_error(tmp_path, monkeypatch, pristine):
    real = writer_module.atomic_write_json

    def full_at_completion(path, data):
        if path.name == "rank-00000.json" and data.get("status") == "complete":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(writer_module, "atomic_write_json", full_at_completion)
    with pytest.raises(StoreWriteError, match=r"could not mark rank 0 of .* complete \(\[Errno 28\] No space left on "
                                              r"device.*\): its 10 rows \(3 shards\) are committed and readable .*"
                                              r"resume with resume=True"):
        _collect(tmp_path / "store")
    store = tmp_path / "store"
    assert _json(store / "rank-00000.json")["status"] == "writing"
    assert not (store / "rank-00000.lock").exists()
    with pytest.raises(StoreError, match=r"incomplete \(rank 0: writing\)"):
        GradientStore.open(store)
    original = GradientStore.open(pristine)
    assert torch.equal(GradientStore.open(store, allow_incomplete=True).read(0, NUM), original.read(0, NUM))
    monkeypatch.setattr(writer_module, "atomic_write_json", real)  # space again: resume completes it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = _collect(store, resume=True)
    assert resumed.complete and resumed.ids == original.ids
    assert torch.equal(resumed.read(0, NUM), original.read(0, NUM))
