"""Lock files and exclusive creation: exactly one taker, also when a dead writer's lock is taken over."""

import json
import os
import socket
import subprocess
import sys
import threading
from unittest import mock

import pytest

from gradtrace.store.artifact import create_exclusive
from gradtrace.store.layout import StoreError, acquire_lock, lock_file, release_lock


def _race(target, n=8):
    barrier = threading.Barrier(n)
    results = []

    def run():
        barrier.wait()
        try:
            results.append(target())
        except StoreError as err:
            results.append(err)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.mark.parametrize("stale", [False, True])
def test_exactly_one_of_many_concurrent_takers_gets_the_lock(tmp_path, stale):
    if stale:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        lock_file(tmp_path, 0).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    results = _race(lambda: acquire_lock(tmp_path, 0))
    winners = [r for r in results if not isinstance(r, StoreError)]
    assert len(winners) == 1, results
    assert all(f"pid {os.getpid()}" in str(r) for r in results if isinstance(r, StoreError))
    holder = json.loads(lock_file(tmp_path, 0).read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    release_lock(tmp_path, 0)
    assert not lock_file(tmp_path, 0).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary files left


def test_release_leaves_another_holders_lock_alone(tmp_path):
    other = {"pid": os.getppid(), "host": socket.gethostname()}
    lock_file(tmp_path, 3).write_text(json.dumps(other))
    release_lock(tmp_path, 3)
    assert json.loads(lock_file(tmp_path, 3).read_text()) == other


def test_create_exclusive_without_hard_links(tmp_path):
    assert create_exclusive(tmp_path / "a", b"first")
    assert not create_exclusive(tmp_path / "a", b"second")
    with mock.patch("os.link", side_effect=PermissionError(1, "Operation not permitted")):
        assert create_exclusive(tmp_path / "b", b"first")
        assert not create_exclusive(tmp_path / "b", b"second")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
