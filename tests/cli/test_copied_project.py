"""A copied project reads its own files: the store manifest and the scores record the model and data relative to
their folder (issue #17, repeatable runs)."""

from __future__ import annotations

import json
import shutil

import gradtrace
from tests.cli.conftest import invoke


def test_a_copied_project_scores_with_the_copys_model(ws, runner, tmp_path):
    original = tmp_path / "project"
    original.mkdir()
    shutil.copytree(ws.model, original / "model")
    shutil.copy(ws.train, original / "train.jsonl")
    invoke(runner, "collect", original / "model", original / "train.jsonl", "--out", original / "store", "--rank", 2,
           "--no-progress")
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    # the original's model now has other weights (same architecture): scoring with it would warn
    shutil.rmtree(original / "model")
    shutil.copytree(ws.model2, original / "model")
    result = invoke(runner, "score", copy / "store", ws.queries, "--out", copy / "scores", "--topk", 3,
                    "--no-progress")
    assert "differ" not in result.output
    scores = gradtrace.Scores.load(copy / "scores")
    assert scores.meta["config"]["model"] == [str(copy / "model")]
    assert scores.meta["config"]["store"] == str(copy / "store")
    saved = json.loads((copy / "scores" / "scores.json").read_text())["meta"]["config"]
    assert (saved["model"], saved["store"]) == (["../model"], "../store")
    # with the original gone, the copy still scores (and topk/report read the copy's data)
    shutil.rmtree(original)
    invoke(runner, "score", copy / "store", ws.queries, "--out", copy / "scores2", "--topk", 3, "--no-progress")
    again = gradtrace.Scores.load(copy / "scores2")
    assert again.top[0].tolist() == scores.top[0].tolist() and again.top[1].tolist() == scores.top[1].tolist()
    rows = json.loads(invoke(runner, "topk", copy / "scores2", "--k", 1, "--data", copy / "train.jsonl",
                             "--format", "json").stdout)
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in ws.train.read_text().splitlines()}
    assert [r["train_text"] for r in rows] == [texts[r["train_id"]] for r in rows]
    invoke(runner, "report", copy / "scores2")  # its texts: from the data the copied store records (the copy's)
    from markupsafe import escape  # as the report's templates escape

    assert str(escape(texts[rows[0]["train_id"]])) in (copy / "scores2" / "report.html").read_text()
