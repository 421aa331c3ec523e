"""Bad distributed input fails clearly on every rank, never hangs, and never corrupts a store.

* Ranks that capture different layers, or project with another seed, into one store: one cheap collective
  at the start of the capture compares them, and every rank raises ``RankMismatch`` naming the rank and
  the difference (no hook is left on the model, nothing is written).
* A rank killed (SIGKILL) after committing a shard: the other rank's next collective fails, its writer
  marks the rank interrupted; the store opens with ``allow_incomplete=True`` holding exactly the committed
  rows, and a resumed 2-rank run completes it with the vectors of an uninterrupted run.
* A store another run is writing: the second run is refused on every rank at the start, naming the
  holder, and the first run finishes undisturbed; a third process is refused by the lock files too.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from gradtrace.store import GradientStore, ShardWriter, StoreError
from tests.distributed import jobs
from tests.distributed.launch import run_ranks, start_ranks


@functools.cache
def _reference():
    return jobs.single_process("mlp", True)


def _check_vectors(store: GradientStore) -> None:
    want = _reference()
    vectors = store.read(0, len(store))
    for row, ident in enumerate(store.ids):
        torch.testing.assert_close(vectors[row], want[ident], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("what, difference", [
    ("layers", "rank 1: capture.parameters.net.6.weight is missing"),
    ("projection", "rank 1: capture.projection.seed is 8 where rank 0 has 7"),
])
def test_ranks_that_disagree_fail_on_every_rank(tmp_path, what, difference):
    results = run_ranks(jobs.disagreeing_ranks, str(tmp_path / "store"), what, timeout=40)
    for result in results:
        assert result["error"].startswith(f"RankMismatch: gradtrace: the 2 ranks writing {tmp_path / 'store'} "
                                          "disagree on what they capture and store: "), result["error"]
        assert difference in result["error"]
        assert result["seconds"] < 10 and result["hooks_left"] == 0
    assert not (tmp_path / "store" / "manifest.json").exists()


def test_killed_rank_leaves_a_readable_resumable_store(tmp_path):
    path = tmp_path / "store"
    started = time.monotonic()
    rank0, rank1 = run_ranks(jobs.dying_rank, str(path), False, timeout=40, may_die=(1,))
    assert rank1 is None  # SIGKILLed
    assert rank0["error"] is not None, "rank 0's next collective must fail, not hang"
    assert time.monotonic() - started < 30

    incomplete = r"incomplete \(rank 0: interrupted, rank 1: writing, writer pid \d+ .* gone\)"
    with pytest.raises(StoreError, match=incomplete):
        GradientStore.open(path)
    partial = GradientStore.open(path, allow_incomplete=True)
    assert sorted(partial.ids) == ["ex0", "ex1", "ex4", "ex5"]  # the first batch of each rank, committed
    _check_vectors(partial)

    run_ranks(jobs.dying_rank, str(path), True, timeout=40)
    store = GradientStore.open(path)
    assert store.complete and sorted(store.ids) == jobs.IDS
    _check_vectors(store)
    assert [store.ranks[r]["skipped"]["already_stored"] for r in (0, 1)] == [2, 2]


def test_a_store_written_by_another_run_is_refused_on_every_rank(tmp_path):
    path, signals = tmp_path / "store", tmp_path / "signals"
    signals.mkdir()
    holder = start_ranks(jobs.holding_run, str(path), str(signals))
    try:
        deadline = time.monotonic() + 30
        while not all((signals / f"ready-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all((signals / f"ready-{r}").exists() for r in (0, 1)), "the first run did not start"

        for result in run_ranks(jobs.disagreeing_ranks, str(path), "nothing", timeout=40):
            assert result["error"].startswith(f"StoreError: {path} is being written by another run (rank 0 by pid ")
            assert "rank 1 by pid" in result["error"] and result["hooks_left"] == 0
        spec = GradientStore.open(path, allow_incomplete=True).spec
        with pytest.raises(StoreError, match=r"is being written by another run \(pid \d+"):
            ShardWriter(path, spec, rank=1, world_size=2)
    finally:
        (signals / "go").touch()
        results = holder.wait(timeout=40)
    assert [r["rows"] for r in results] == [4, 4]
    store = GradientStore.open(path)
    assert store.complete and sorted(store.ids) == jobs.IDS
    _check_vectors(store)
