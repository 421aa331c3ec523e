"""``gradtrace report``: texts from the data the scores record (or --data/--queries), self-influence from the
recorded store, and one-line errors for bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from markupsafe import escape

import gradtrace
import gradtrace.data as gd
from gradtrace.cli.load_model import load_tokenizer
from gradtrace.options.data import ReadOptions
from tests.cli.conftest import error_line, flat, invoke
from tests.report.helpers import only_our_script, parse, section


def _tids(html: str) -> list[str]:
    return re.findall(r'<code class="tid">([^<]*)</code>', html)


def test_report_from_recorded_data(ws, runner, scores_dir, fresh):
    out = fresh / "r.html"
    result = invoke(runner, "report", scores_dir, "--out", out, "--k", 3)
    assert f"written to {out}" in flat(result.output)
    html = out.read_text(encoding="utf-8")
    scores = gradtrace.Scores.load(scores_dir)
    query_texts = gd.texts(ws.queries, load_tokenizer(ws.model), read_options=ReadOptions(max_length=48))
    train_texts = gd.texts(ws.train)
    helpful, harmful = scores.topk(3), scores.topk(3, largest=False)
    page = parse(html)
    for q, qid in enumerate(scores.query_ids):
        article = section(html, f"q{q}")
        assert str(escape(query_texts[qid])) in article
        assert _tids(article) == helpful.ids[q] + harmful.ids[q]
        for tid in helpful.ids[q]:
            assert str(escape(train_texts[tid])) in article
    assert only_our_script(page) and "http:" not in html and "https:" not in html
    assert "kept full score matrix" in " ".join(page.text.split())


def test_default_out_is_beside_the_scores(runner, scores_dir, fresh):
    copy = shutil.copytree(scores_dir, fresh / "scores")
    invoke(runner, "report", copy)
    assert (copy / "report.html").stat().st_size > 1000


def test_data_and_queries_options(ws, runner, scores_dir, fresh):
    scores = gradtrace.Scores.load(scores_dir)
    data, queries = fresh / "train.jsonl", fresh / "queries.jsonl"
    data.write_text("".join(json.dumps({"key": ident, "body": f"text of {ident}"}) + "\n"
                            for ident in gd.texts(ws.train)))
    queries.write_text("".join(json.dumps({"key": q, "body": f"query text {n}"}) + "\n"
                               for n, q in enumerate(scores.query_ids)))
    invoke(runner, "report", scores_dir, "--out", fresh / "r.html", "--data", data, "--queries", queries,
           "--text-field", "body", "--id-field", "key")
    html = (fresh / "r.html").read_text()
    assert "query text 2" in section(html, "q2")
    top = scores.topk(1).ids[2][0]
    assert f'<div class="tx">text of {top}</div>' in section(html, "q2")


def test_self_influence_from_the_recorded_store(runner, store, scores_dir, fresh):
    out = fresh / "r.html"
    invoke(runner, "report", scores_dir, "--out", out, "--self-influence", "--self-k", 5)
    expected = gradtrace.Attributor("grad_dot", store).self_scores()
    ids = gradtrace.GradientStore.open(store).ids
    part = section(out.read_text(), "self")
    assert _tids(part) == [ids[i] for i in torch.argsort(expected, descending=True)[:5].tolist()]
    shown = [float(v) for v in re.findall(r'<span class="sc pos">([^<]*)</span>', part)]
    assert shown == pytest.approx(torch.sort(expected, descending=True).values[:5].tolist(), rel=5e-4)


def test_self_influence_with_grad_cos_is_refused(runner, scores_dir, fresh):
    line = error_line(invoke(runner, "report", scores_dir, "--out", fresh / "r.html", "--self-influence",
                             "--self-method", "grad_cos", code=2))
    assert "1 for every training example" in line and "--self-method grad_dot" in line
    assert not (fresh / "r.html").exists()


def test_scores_without_recorded_data_name_the_option(runner, fresh):
    scores = gradtrace.Scores(["a", "b"], ["q"], "grad_dot", matrix=torch.tensor([[1.0, -1.0]]))
    scores.save(fresh / "s")
    line = error_line(invoke(runner, "report", fresh / "s", "--out", fresh / "r.html", code=2))
    assert "record no training data" in line and "pass --data TRAIN.jsonl" in line
    data = fresh / "d.jsonl"
    data.write_text('{"id": "a", "text": "A"}\n{"id": "b", "text": "B"}\n')
    line = error_line(invoke(runner, "report", fresh / "s", "--out", fresh / "r.html", "--data", data, code=2))
    assert "pass --queries QUERIES.jsonl" in line


def test_ids_missing_from_data(ws, runner, scores_dir, fresh):
    data = fresh / "other.jsonl"
    data.write_text('{"id": "x1", "text": "unrelated"}\n')
    line = error_line(invoke(runner, "report", scores_dir, "--out", fresh / "r.html", "--data", data, code=2))
    assert re.search(r"training id 't\d+' is not in --data .*other\.jsonl \(\d+ more are missing too\)", line)


def test_non_finite_scores(runner, scores_dir, fresh):
    scores = gradtrace.Scores.load(scores_dir)
    scores.matrix[0, 5] = float("nan")
    scores.save(fresh / "s")
    out = fresh / "r.html"
    out.write_text("old report")
    line = error_line(invoke(runner, "report", fresh / "s", "--out", out, "--overwrite", code=2))
    # refused by the report (naming the pair), or already by Scores.load where it checks values (naming the query)
    assert re.search(r"non-finite|NaN/inf", line) and scores.query_ids[0] in line
    assert out.read_text() == "old report"


def test_missing_scores_and_directory_out(runner, scores_dir, fresh):
    line = error_line(invoke(runner, "report", fresh / "none", code=2))
    assert f"score directory {fresh / 'none'} does not exist" in line
    (fresh / "empty").mkdir()
    line = error_line(invoke(runner, "report", fresh / "empty", code=2))
    assert "holds no saved scores" in line
    line = error_line(invoke(runner, "report", scores_dir, "--out", fresh, code=2))
    assert "is a directory" in line


def test_help(runner):
    text = flat(invoke(runner, "report", "--help").output)
    assert "self-contained HTML" in text and "--self-influence" in text and "--data" in text


def test_self_influence_of_an_influence_method_uses_the_recorded_curvature(ws, runner, store, fresh):
    curvature = fresh / "curv"
    invoke(runner, "fit", store, "--method", "logra", "--fisher", "empirical", "--out", curvature, "--no-progress")
    invoke(runner, "score", store, ws.queries, "--method", "logra", "--curvature", curvature, "--damping", 0.5,
           "--out", fresh / "scores", "--no-progress")
    invoke(runner, "report", fresh / "scores", "--out", fresh / "r.html", "--self-influence", "--self-k", 4)
    expected = gradtrace.Attributor("logra", store, curvature=curvature, damping=0.5).self_scores()
    ids = gradtrace.GradientStore.open(store).ids
    part = section((fresh / "r.html").read_text(), "self")
    assert "(logra)" in part
    assert _tids(part) == [ids[i] for i in torch.argsort(expected, descending=True)[:4].tolist()]
    undamped = gradtrace.Attributor("logra", store, curvature=curvature).self_scores()
    # the recorded damping mattered: 0.5 against the default 0.1 moves self-influence far beyond float32 round-off
    assert float((undamped - expected).abs().max()) > 1e-2 * float(expected.abs().max())
