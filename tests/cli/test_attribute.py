"""``gradtrace attribute RUN_DIR DATA QUERIES --out DIR``: the steps it runs equal running the commands by hand, it
resumes the stores on a second run, and it refuses to overwrite scores or a report unless asked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import gradtrace
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import error_line, invoke

ws, runner = cli_fixtures.ws, cli_fixtures.runner


@pytest.fixture
def run_dir(ws, tmp_path) -> Path:
    """A Trainer-like output directory: checkpoint-5 (ws.model2's weights) and checkpoint-40 (ws.model's)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(ws.model2, run / "checkpoint-5")
    shutil.copytree(ws.model, run / "checkpoint-40")
    return run


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_attribute_runs_collect_score_report_and_equals_the_commands_by_hand(ws, runner, run_dir, tmp_path):
    out = tmp_path / "attribution"
    result = invoke(runner, "attribute", run_dir, ws.train, ws.queries, "--out", out, "--rank", 4, "--k", 3,
                    "--no-progress")
    assert "2 checkpoints" in result.output and "an ensemble of the run's checkpoints" in result.output
    assert sorted(p.name for p in (out / "stores").iterdir()) == ["checkpoint-40", "checkpoint-5"]
    assert (out / "report.html").read_text().lower().startswith("<!doctype html>")
    scores = gradtrace.Scores.load(out / "scores")
    assert "diagnostics" in scores.meta and scores.meta["distribution"]["rows"] == 24
    # by hand: the same stores, the latest checkpoint first
    invoke(runner, "score", out / "stores" / "checkpoint-40", ws.queries, "--store", out / "stores" / "checkpoint-5",
           "--method", "grad_cos", "--out", tmp_path / "by_hand", "--topk", 3, "--no-progress")
    by_hand = gradtrace.Scores.load(tmp_path / "by_hand")
    assert scores.query_ids == by_hand.query_ids and scores.train_ids == by_hand.train_ids
    assert torch.equal(scores.top[1], by_hand.top[1]) and torch.equal(scores.top[0], by_hand.top[0])


def test_a_second_run_resumes_the_stores_and_refuses_to_overwrite_unless_asked(ws, runner, run_dir, tmp_path):
    out = tmp_path / "attribution"
    args = ["attribute", run_dir, ws.train, ws.queries, "--out", out, "--rank", 4, "--k", 3, "--no-progress"]
    invoke(runner, *args)
    stores = _files(out / "stores")
    report = (out / "report.html").read_bytes()
    line = error_line(invoke(runner, *args, code=2))
    assert "already holds scores" in line and "--overwrite" in line
    assert (out / "report.html").read_bytes() == report
    invoke(runner, *args, "--overwrite")
    again = _files(out / "stores")
    shards = [name for name in stores if "/shards/" in name]
    assert shards and all(again[name] == stores[name] for name in shards)  # resumed: no shard rewritten


def test_a_run_without_checkpoints_is_refused_before_any_work(ws, runner, tmp_path):
    (tmp_path / "empty").mkdir()
    line = error_line(invoke(runner, "attribute", tmp_path / "empty", ws.train, ws.queries, "--out", tmp_path / "o",
                             code=2))
    assert "holds no Trainer checkpoint" in line and not (tmp_path / "o").exists()
