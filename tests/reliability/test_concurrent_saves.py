"""Artifacts under concurrency and kills (issue #27): two real processes saving to one directory, a process
killed at every step of an index rebuild, and FAISS data bound to its manifest.

Before the fix, two ``Scores.save(same_dir)`` at the same instant left an unloadable directory in 22 of 40 trials
(each writer deleted the other's tensor file) and both reported success in 6 of them; ``index --overwrite``
replaced ``index.faiss`` before ``index.json``, so a kill between them left IVF-PQ data under flat metadata; and a
foreign or bit-flipped ``index.faiss`` was accepted.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.options.index import IndexOptions
from gradtrace.score.index import Index, IndexMismatch, build_index
from gradtrace.store.artifact import ArtifactExists, artifact_file
from gradtrace.store.locking import DIRECTORY_LOCK, LockedError, directory_lock
from tests.score.legacy_index import save_v1

TRIALS = 40
_fork = multiprocessing.get_context("fork")


def _scores(seed: int) -> gradtrace.Scores:
    matrix = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))
    return gradtrace.Scores([f"t{i}" for i in range(50)], ["a", "b", "c"], "grad_dot", matrix=matrix)


def _saver(seed: int, root: str, overwrite: bool, barrier, results) -> None:
    """One real process: save its own scores in each trial's directory at the same instant as the other."""
    scores = _scores(seed)
    for trial in range(TRIALS):
        barrier.wait(timeout=60)
        try:
            scores.save(Path(root) / f"t{trial:02d}", overwrite=overwrite)
            outcome = "saved"
        except LockedError as err:
            outcome = "locked" if "being written by another run" in str(err) else f"bad lock message: {err}"
        except ArtifactExists:
            outcome = "exists"
        except BaseException as err:  # anything else is a failure of the test
            outcome = f"error: {err!r}"
        results.put((trial, seed, outcome))


def _race(root: Path, overwrite: bool) -> dict[int, dict[int, str]]:
    barrier, results = _fork.Barrier(2), _fork.Queue()
    workers = [_fork.Process(target=_saver, args=(seed, str(root), overwrite, barrier, results)) for seed in (1, 2)]
    for worker in workers:
        worker.start()
    outcomes: dict[int, dict[int, str]] = {}
    for _ in range(2 * TRIALS):
        trial, seed, outcome = results.get(timeout=120)
        outcomes.setdefault(trial, {})[seed] = outcome
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    return outcomes


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_saving_scores_to_one_directory_never_break_or_silently_lose_a_result(tmp_path, overwrite):
    """Without overwrite: exactly one process saves, the other is refused (locked, or told scores exist) -- never
    two successes. With overwrite both may save one after the other; the directory always loads and holds the
    scores of a process that reported success, and no lock or temporary file is left behind."""
    outcomes = _race(tmp_path, overwrite)
    for trial, by_seed in sorted(outcomes.items()):
        assert not [o for o in by_seed.values() if o not in ("saved", "locked", "exists")], (trial, by_seed)
        saved = [seed for seed, outcome in by_seed.items() if outcome == "saved"]
        assert saved, (trial, by_seed)
        if not overwrite:
            assert len(saved) == 1, (trial, by_seed)
        loaded = gradtrace.Scores.load(tmp_path / f"t{trial:02d}")
        assert any(torch.equal(loaded.matrix, _scores(seed).matrix) for seed in saved), (trial, by_seed)
        assert sorted(p.name for p in (tmp_path / f"t{trial:02d}").iterdir() if p.name.startswith(".")) == []


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    with directory_lock(tmp_path / "s", "scores"):
        child = _fork.Process(target=_save_expecting_lock, args=(str(tmp_path / "s"), os.getpid()))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
    assert not (tmp_path / "s" / DIRECTORY_LOCK).exists()
    _scores(1).save(tmp_path / "s")  # released: the next writer goes ahead


def _save_expecting_lock(root: str, holder_pid: int) -> None:
    try:
        _scores(2).save(root)
    except LockedError as err:
        os._exit(0 if f"pid {holder_pid} on" in str(err) else 3)
    os._exit(4)


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    child = _fork.Process(target=_hold_and_die, args=(str(tmp_path / "s"),))
    child.start()
    child.join(timeout=60)
    assert (tmp_path / "s" / DIRECTORY_LOCK).exists()  # the dead process's lock
    _scores(1).save(tmp_path / "s")
    assert torch.equal(gradtrace.Scores.load(tmp_path / "s").matrix, _scores(1).matrix)


def _hold_and_die(root: str) -> None:
    with directory_lock(root, "scores"):
        os._exit(9)  # killed while holding it: no clean-up runs


# -- the index -------------------------------------------------------------------------------------------
faiss = pytest.importorskip("faiss")
ROWS, DIM = 640, 32


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    spec = gradtrace.GradientSpec([("w", DIM)], projection=None, convention={"reduction": "sum", "example_loss": "sum"})
    made = []
    for seed in (0, 1):
        vectors = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
        made.append(gradtrace.GradientSet(vectors, [f"t{i}" for i in range(ROWS)], spec).save(root / f"s{seed}"))
    return made


def _queries(store) -> torch.Tensor:
    return torch.randn(5, DIM, generator=torch.Generator().manual_seed(7))


def _killing_save(index: Index, where: str, kill_at: int) -> None:
    """Save ``index`` over ``where`` in this (forked) process, killed (``os._exit``, no clean-up) at the
    ``kill_at``-th file-system step of the save: a write's fsync, a rename, an unlink."""
    steps = {"n": 0}

    def step(real):
        def wrapped(*args, **kwargs):
            steps["n"] += 1
            if steps["n"] == kill_at:
                os._exit(9)
            return real(*args, **kwargs)
        return wrapped

    os.fsync, os.replace, os.unlink = step(os.fsync), step(os.replace), step(os.unlink)
    index.save(where, overwrite=True)
    os._exit(0)


def test_a_kill_at_each_step_of_an_index_rebuild_leaves_the_old_index_loading_and_searching_as_before(
        stores, tmp_path):
    store = stores[0]
    old = build_index(store)
    old.save(tmp_path / "index")
    before_values, before_rows = Index.load(tmp_path / "index").search(_queries(store), 10)
    new = build_index(store, IndexOptions(kind="ivfpq", nlist=4, m=8, nbits=4, train_rows=ROWS))
    kills = 0
    for kill_at in range(1, 100):
        child = _fork.Process(target=_killing_save, args=(new, str(tmp_path / "index"), kill_at))
        child.start()
        child.join(timeout=120)
        loaded = Index.load(tmp_path / "index")  # whole after every kill: the old index or the new one
        if child.exitcode == 0:
            assert loaded.params.kind == "ivfpq" and loaded.params.nlist == 4
            break
        assert child.exitcode == 9
        kills += 1
        if loaded.params.kind == "flat":
            values, rows = loaded.search(_queries(store), 10)
            assert torch.equal(rows, before_rows) and torch.equal(values, before_values)
            assert torch.equal(loaded.row_norms, old.row_norms)
        else:  # killed after the publishing rename: the new index, whole
            assert loaded.params.nlist == 4 and len(loaded) == ROWS
    assert kills >= 5  # the writes and renames of three files, and the clean-up
    # what the killed saves left (temporaries, unpublished files) is removed by the next save
    new.save(tmp_path / "index", overwrite=True)
    manifest = json.loads((tmp_path / "index" / "index.json").read_text())
    kept = {"index.json", manifest["tensors"]["file"], manifest["files"]["faiss"]["file"]}
    assert {p.name for p in (tmp_path / "index").iterdir()} == kept


def test_faiss_data_of_another_index_or_with_a_flipped_bit_is_refused(stores, tmp_path):
    """A flat index (documented as exact) with another store's FAISS data used to answer with the wrong top-k."""
    mine, theirs = build_index(stores[0]), build_index(stores[1])
    mine.save(tmp_path / "mine")
    theirs.save(tmp_path / "theirs")
    data = artifact_file(tmp_path / "mine", json.loads((tmp_path / "mine" / "index.json").read_text()), "faiss")
    original = data.read_bytes()
    foreign = artifact_file(tmp_path / "theirs", json.loads((tmp_path / "theirs" / "index.json").read_text()),
                            "faiss")
    shutil.copyfile(foreign, data)  # same size: only the checksum tells
    with pytest.raises(IndexMismatch, match=r"corrupted or was replaced.*rebuild it"):
        Index.load(tmp_path / "mine")
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    data.write_bytes(bytes(flipped))
    with pytest.raises(IndexMismatch, match=r"corrupted or was replaced"):
        Index.load(tmp_path / "mine")
    data.write_bytes(original)
    assert torch.equal(Index.load(tmp_path / "mine").search(_queries(stores[0]), 5)[1],
                       mine.search(_queries(stores[0]), 5)[1])
    # the whole directory of another store's index: loads, but is refused against this store
    with pytest.raises(IndexMismatch, match="built from another store"):
        Index.load(tmp_path / "theirs").check_store(stores[0])


def test_faiss_data_of_another_kind_under_a_version_1_manifest_is_refused(stores, tmp_path):
    """Version-1 indexes carry no checksums; their FAISS data must still be of the kind and shape recorded."""
    flat = build_index(stores[0])
    ivf = build_index(stores[0], IndexOptions(kind="ivfpq", nlist=4, m=8, nbits=4, train_rows=ROWS))
    save_v1(flat, tmp_path / "old")
    faiss.write_index(ivf.faiss_index, str(tmp_path / "old" / "index.faiss"))
    with pytest.warns(UserWarning), pytest.raises(IndexMismatch, match=r"is not the index index.json describes"):
        Index.load(tmp_path / "old")
