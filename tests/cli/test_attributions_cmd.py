"""``gradtrace score --modules`` / ``--tokens``: pair attributions saved with the scores, read by the report."""

from __future__ import annotations

import gradtrace
from tests.cli.conftest import error_line, invoke

EPS32 = 2.0 ** -23


def test_score_modules_saved_and_reported(ws, runner, store, fresh):
    out = fresh / "scores"
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", out, "--topk", 3, "--modules",
           "--no-progress")
    scores = gradtrace.Scores.load(out)
    top, bottom = scores.topk(3), scores.topk(3, largest=False)
    names = [n for n, _ in gradtrace.GradientStore.open(store).spec.params]
    for q, qid in enumerate(scores.query_ids):
        for tid, value in zip(top.ids[q] + bottom.ids[q], top.values[q].tolist() + bottom.values[q].tolist()):
            blocks = scores.modules(qid, tid)
            assert list(blocks) == names
            magnitude = sum(abs(v) for v in blocks.values())
            assert abs(sum(blocks.values()) - value) <= 4 * EPS32 * store_dim(store) * magnitude + 1e-30
    invoke(runner, "report", out, "--out", fresh / "r.html", "--k", 3)
    html = (fresh / "r.html").read_text(encoding="utf-8")
    top_block = max(scores.modules(scores.query_ids[0], top.ids[0][0]).items(), key=lambda nv: abs(nv[1]))[0]
    assert top_block in html  # the report checked the sums and drew the bars


def test_modules_need_a_topk(ws, runner, store, fresh):
    result = invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", fresh / "s", "--topk", 0,
                    "--matrix", "yes", "--modules", "--no-progress", code=2)
    assert "--modules" in error_line(result) and "--topk" in error_line(result)


def store_dim(store) -> int:
    return gradtrace.GradientStore.open(store).spec.dim
