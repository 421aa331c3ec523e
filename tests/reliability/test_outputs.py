"""No output is ever overwritten without --overwrite, nor written inside a store or another artifact; each
refusal comes before any model work, is one line, and leaves every file byte-identical (issue #27).

Before the fix: ``score --export S/scores.json`` destroyed the scores it had just saved, ``--export
STORE/manifest.json`` made the store unopenable, and ``report --out train.jsonl`` replaced the training data
with HTML -- each with exit 0.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gradtrace
from gradtrace.cli import score_queries  # where gradtrace score loads the models of its queries
from gradtrace.store.locking import DIRECTORY_LOCK, directory_lock
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import error_line, invoke

ws, runner, store, scores_dir = cli_fixtures.ws, cli_fixtures.runner, cli_fixtures.store, cli_fixtures.scores_dir


def _snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` (or the file itself) and its bytes."""
    files: dict[str, bytes] = {}
    for root in roots:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        files.update({str(p): p.read_bytes() for p in paths})
    return files


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every refusal here must come before any model work."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(score_queries, "load_model", refuse)


RUNNER = CliRunner()


def _score(ws, store, *args, code=0):
    return invoke(RUNNER, "score", store, ws.queries, "--model", ws.model, "--no-progress", *args, code=code)


def test_export_over_the_scores_it_saves_or_into_a_store_is_refused(ws, store, tmp_path, no_model):
    copied = tmp_path / "store"
    shutil.copytree(store, copied)
    before = _snapshot(copied)
    out = tmp_path / "s"
    for export, why in ((out / "scores.json", "would replace a file of a gradtrace artifact"),
                        (copied / "manifest.json", "already exists"),
                        (copied / "top.csv", "lies inside .* which is a gradient store")):
        line = error_line(_score(ws, copied, "--out", out, "--export", export, "--overwrite", code=2)
                          if why != "already exists" else
                          _score(ws, copied, "--out", out, "--export", export, code=2))
        assert re.search(why, line), line
        assert not out.exists()
    assert _snapshot(copied) == before
    # with --overwrite, a store's manifest is still not a file an export may replace
    line = error_line(_score(ws, copied, "--out", out, "--export", copied / "manifest.json", "--overwrite", code=2))
    assert "would replace a file of a gradtrace artifact (manifest.json)" in line
    assert _snapshot(copied) == before


def test_score_out_that_is_a_store_an_index_or_locked_is_refused(ws, store, scores_dir, tmp_path, no_model):
    line = error_line(_score(ws, store, "--out", store, code=2))
    assert "is a gradient store" in line
    line = error_line(_score(ws, store, "--out", scores_dir / "inner", code=2))
    assert "lies inside" in line and "saved scores" in line
    busy = tmp_path / "busy"
    with directory_lock(busy, "scores"):
        line = error_line(_score(ws, store, "--out", busy, code=2))
        assert f"pid {os.getpid()}" in line and "being written by another run" in line
    assert not (busy / DIRECTORY_LOCK).exists()


def test_existing_files_are_not_replaced_without_overwrite(ws, store, scores_dir, tmp_path, no_model):
    train = tmp_path / "train.jsonl"
    shutil.copyfile(ws.train, train)
    export = tmp_path / "top.csv"
    export.write_text("mine\n")
    before = _snapshot(train, export, scores_dir)
    line = error_line(invoke(RUNNER, "report", scores_dir, "--out", train, code=2))
    assert f"--out {train} already exists: pass --overwrite" in line
    line = error_line(_score(ws, store, "--out", tmp_path / "s", "--export", export, code=2))
    assert f"--export {export} already exists" in line
    line = error_line(invoke(RUNNER, "self-influence", store, "--out", export, code=2))
    assert "already exists" in line
    assert _snapshot(train, export, scores_dir) == before
    assert not (tmp_path / "s").exists()


def test_special_and_looping_output_paths_are_refused(ws, store, scores_dir, tmp_path, no_model):
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    line = error_line(_score(ws, store, "--out", tmp_path / "s", "--export", fifo, "--overwrite", code=2))
    assert "not a regular file" in line
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    line = error_line(_score(ws, store, "--out", loop, code=2))
    assert "symbolic link loop" in line
    line = error_line(invoke(RUNNER, "report", scores_dir, "--out", loop / "r.html", code=2))
    assert "symbolic link loop" in line
    link = tmp_path / "into-store"
    link.symlink_to(store)  # a link into a store is followed
    line = error_line(_score(ws, store, "--out", tmp_path / "s", "--export", link / "x.csv", code=2))
    assert "gradient store" in line


def test_overwrite_replaces_and_the_report_beside_its_scores_is_fine(ws, store, scores_dir, tmp_path):
    shutil.copytree(scores_dir, tmp_path / "s")
    invoke(RUNNER, "report", tmp_path / "s")  # SCORES_DIR/report.html: inside its own scores, a free name
    line = error_line(invoke(RUNNER, "report", tmp_path / "s", code=2))
    assert "report.html already exists: pass --overwrite" in line
    invoke(RUNNER, "report", tmp_path / "s", "--overwrite")
    assert gradtrace.Scores.load(tmp_path / "s").shape == gradtrace.Scores.load(scores_dir).shape
