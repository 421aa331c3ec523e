"""A capture killed with SIGKILL and resumed gives the store an uninterrupted run gives."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradtrace.options import StoreOptions
from gradtrace.store import GradientStore, ShardWriter, StoreError
from tests.store import capture_job, collect_job
from tests.store.common import make_rows, make_spec, status

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(capture_job.__file__)


def _run_job(path, *args, kill_after=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADTRACE_TEST_THREADS": "1"}
    env.pop("GRADTRACE_TEST_KILL_AFTER", None)
    if kill_after is not None:
        env["GRADTRACE_TEST_KILL_AFTER"] = str(kill_after)
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _as_dict(store):
    vectors = store.read(0, len(store))
    return {ident: vectors[row] for row, ident in enumerate(store.ids)}


def test_killed_capture_resumes_to_the_uninterrupted_result(tmp_path):
    killed_path, full_path = tmp_path / "killed", tmp_path / "full"
    killed = _run_job(killed_path, kill_after=5)  # 20 rows captured: 3 full shards of 6 committed, 2 rows lost
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    # the killed store: refused as incomplete, readable up to its last committed shard
    with pytest.raises(StoreError, match=r"incomplete \(rank 0: writing, writer pid \d+ on .* gone\)") as err:
        GradientStore.open(killed_path)
    assert "18 committed rows are readable" in str(err.value)
    partial = GradientStore.open(killed_path, allow_incomplete=True)
    assert partial.ids == capture_job.example_ids()[:18]
    assert [s.rows for s in partial.shards] == [6, 6, 6]
    holder = (killed_path / "rank-00000.lock").read_text()
    assert f'"host": "{socket.gethostname()}"' in holder  # the dead writer's lock is still there

    # what a kill in the middle of a shard leaves: a temporary file, a data file without its record
    (killed_path / "shards" / ".tmp-r00000-000003.data").write_bytes(b"partial")
    (killed_path / "shards" / "r00000-000003.data").write_bytes(b"\0" * 17)

    capture_job.run(full_path)  # the uninterrupted reference, in this process
    resumed = _run_job(killed_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr

    store, full = GradientStore.open(killed_path), GradientStore.open(full_path)
    assert sorted(store.ids) == sorted(full.ids) == capture_job.example_ids()
    assert len(set(store.ids)) == len(store.ids)
    got, want = _as_dict(store), _as_dict(full)
    assert all(torch.equal(got[i], want[i]) for i in want)
    assert store.spec == full.spec
    assert not (killed_path / "rank-00000.lock").exists()  # taken over from the dead pid, then released
    assert not list((killed_path / "shards").glob(".tmp-*"))
    assert status(killed_path)["status"] == "complete"
    assert status(killed_path)["skipped"]["already_stored"] == 18


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    ids, rows = make_rows(4)
    ShardWriter(tmp_path, make_spec()).close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "rank-00000.lock").write_text(f'{{"pid": {dead.pid}, "host": "{socket.gethostname()}"}}')
    with ShardWriter(tmp_path, make_spec(), StoreOptions(resume=True)) as writer:
        assert f'"pid": {os.getpid()}' in (tmp_path / "rank-00000.lock").read_text()
        writer.put(ids, rows)
    assert GradientStore.open(tmp_path).ids == ids


def test_resume_skips_stored_ids_and_continues_shard_numbering(tmp_path):
    ids, rows = make_rows(13)
    writer = ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=4))
    writer.put(ids[:9], rows[:9])
    writer.close(complete=False)
    assert status(tmp_path)["status"] == "interrupted"
    with ShardWriter(tmp_path, make_spec(), StoreOptions(shard_rows=4, resume=True)) as writer:
        assert writer.stored_ids == set(ids[:9]) and writer.rows_written == 9
        writer.put(ids, rows)
    store = GradientStore.open(tmp_path)
    assert store.ids == ids and torch.equal(store.read(0, 13), rows)
    assert [s.name for s in store.shards] == ["r00000-000000", "r00000-000001", "r00000-000002", "r00000-000003"]
    assert [s.rows for s in store.shards] == [4, 4, 1, 4]
    assert status(tmp_path)["skipped"]["already_stored"] == 9 and status(tmp_path)["rows"] == 13


def _run_collect(path, *args, signal_name=None, kill_after=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADTRACE_TEST_THREADS": "1"}
    for key in ("GRADTRACE_TEST_SIGNAL", "GRADTRACE_TEST_KILL_AFTER"):
        env.pop(key, None)
    if signal_name is not None:
        env.update(GRADTRACE_TEST_SIGNAL=signal_name, GRADTRACE_TEST_KILL_AFTER=str(kill_after))
    return subprocess.run([sys.executable, str(Path(collect_job.__file__)), str(path), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _assert_resumes_to_the_full_run(killed_path, full_path):
    resumed = _run_collect(killed_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    collect_job.run(full_path)  # the uninterrupted reference, in this process
    store, full = GradientStore.open(killed_path), GradientStore.open(full_path)
    assert sorted(store.ids) == sorted(full.ids) == collect_job.example_ids()
    got, want = _as_dict(store), _as_dict(full)
    assert all(torch.equal(got[i], want[i]) for i in want)  # bit-exact, int8 values and scales
    assert status(killed_path)["status"] == "complete"
    assert not list((killed_path / "shards").glob(".tmp-*"))


def test_sigterm_in_the_first_shard_commits_the_rows_so_far_and_resumes(tmp_path):
    killed_path = tmp_path / "killed"
    killed = _run_collect(killed_path, signal_name="SIGTERM", kill_after=5)  # 5 batches of 4 captured
    assert killed.returncode != 0 and "Interrupted: stopped by signal SIGTERM" in killed.stderr, killed.stderr
    assert status(killed_path)["status"] == "interrupted"
    partial = GradientStore.open(killed_path, allow_incomplete=True)
    assert partial.ids == collect_job.example_ids()[:20]  # before the fix: 0 rows (the whole shard was lost)
    assert [s.rows for s in partial.shards] == [20]
    assert not (killed_path / "rank-00000.lock").exists()
    _assert_resumes_to_the_full_run(killed_path, tmp_path / "full")
    assert status(killed_path)["skipped"]["already_stored"] == 0  # collect skips stored ids before computing


def test_sigkill_in_the_first_shard_loses_only_that_shard_and_resumes(tmp_path):
    killed_path = tmp_path / "killed"
    killed = _run_collect(killed_path, signal_name="SIGKILL", kill_after=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert status(killed_path)["status"] == "writing"
    assert len(GradientStore.open(killed_path, allow_incomplete=True)) == 0  # the open shard is lost, no more
    _assert_resumes_to_the_full_run(killed_path, tmp_path / "full")


def test_resuming_takes_the_stores_own_dtype_and_an_other_one_is_refused(tmp_path):
    """``StoreOptions(resume=True)`` without a dtype resumes an int8 store as int8 (the run need not repeat it); a
    dtype given that differs from the store's is refused before any gradient."""
    import gradtrace
    from gradtrace.store import SpecMismatch
    from tests import tiny

    torch.manual_seed(0)
    model = tiny.MLP()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 7, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    batches = [{"x": x[i:i + 2], "y": y[i:i + 2], "id": [f"e{j}" for j in range(i, i + 2)]} for i in (0, 2, 4, 6)]

    def loss(m, batch):
        return torch.nn.functional.cross_entropy(m(batch["x"]), batch["y"], reduction="none")

    path = tmp_path / "s"
    first = gradtrace.collect(model, batches[:2], loss, store=path, store_options=StoreOptions(dtype="int8"))
    assert first.spec.dtype == "int8" and len(first) == 4
    whole = gradtrace.collect(model, batches, loss, store=path, store_options=StoreOptions(resume=True))
    assert whole.spec.dtype == "int8" and whole.ids == [f"e{j}" for j in range(8)]
    again = gradtrace.collect(model, batches, loss, store=tmp_path / "once", store_options=StoreOptions(dtype="int8"))
    assert torch.equal(whole.read(0, 8), again.read(0, 8))  # resumed rows equal one uninterrupted int8 run
    with pytest.raises(SpecMismatch, match="int8"):
        gradtrace.collect(model, batches, loss, store=path, store_options=StoreOptions(resume=True, dtype="bfloat16"))
