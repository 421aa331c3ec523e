"""``gradtrace fit`` and ``gradtrace score`` print their plan first; --dry-run stops there; what cannot fit is
refused unless --force."""

from __future__ import annotations

import importlib

from tests.cli.conftest import error_line, flat, invoke
from tests.score.test_progress import _last_frame

FIT_PLAN = importlib.import_module("gradtrace.plan.fit_plan")  # where plan_fit looks the names up
SCORE_PLAN = importlib.import_module("gradtrace.plan.score_plan")


def test_fit_dry_run_prints_the_plan_and_writes_nothing(ws, store, runner, tmp_path):
    out = tmp_path / "curv"
    result = invoke(runner, "fit", store, ws.train, "--method", "kfac", "--fisher", "empirical", "--out", out,
                    "--batch-size", 5, "--dry-run", "--no-progress")
    text = flat(result.output)
    assert "Plan: kfac curvature over 24 examples" in text and "1 pass" in text
    assert "blocks" in text and "curvature about" in text and "free there" in text
    assert not out.exists()
    result = invoke(runner, "fit", store, "--method", "logra", "--out", out, "--dry-run", "--no-progress")
    assert "Plan: logra curvature over 24 stored rows; 1 pass" in flat(result.output) and not out.exists()


def test_fit_refuses_a_curvature_larger_than_the_free_disk(ws, store, runner, tmp_path, monkeypatch):
    monkeypatch.setattr(FIT_PLAN, "free_space", lambda path: 10)
    out = tmp_path / "curv"
    result = invoke(runner, "fit", store, "--method", "logra", "--out", out, "--no-progress", code=2)
    assert "has 10 B free" in error_line(result) and "--force" in error_line(result)
    assert not out.exists()
    invoke(runner, "fit", store, "--method", "logra", "--out", out, "--no-progress", "--force")
    assert (out / "curvature.json").exists()


def test_score_dry_run_prints_the_plan_and_writes_nothing(ws, store, runner, tmp_path):
    out = tmp_path / "scores"
    result = invoke(runner, "score", store, ws.queries, "--out", out, "--block-rows", 10, "--topk", 5, "--dry-run",
                    "--no-progress")
    text = flat(result.output)
    assert "Plan: 3 queries against 24 training rows" in text
    assert "blocks 3 of 10 rows; keeps the full matrix, top/bottom 5" in text
    assert "memory about" in text and "output about" in text and "s/block" in text
    assert not out.exists()


def test_score_refuses_memory_it_does_not_have(ws, store, runner, tmp_path, monkeypatch):
    monkeypatch.setattr(SCORE_PLAN, "available_memory", lambda device=None: 100)
    out = tmp_path / "scores"
    result = invoke(runner, "score", store, ws.queries, "--out", out, "--matrix", "yes", "--no-progress", code=2)
    assert "is available: pass --matrix no" in error_line(result) and not out.exists()
    invoke(runner, "score", store, ws.queries, "--out", out, "--matrix", "yes", "--no-progress", "--force")
    assert (out / "scores.json").exists()


def test_score_command_labels_the_query_bar(ws, store, runner, tmp_path):
    result = invoke(runner, "score", store, ws.queries, "--out", tmp_path / "s", "--block-rows", 10, "--progress")
    text = result.output  # the CliRunner mixes stderr into output
    assert "collect queries:" in text
    assert "24/24" in _last_frame(text, "score") and "block 3/3" in _last_frame(text, "score")


def test_self_influence_command(ws, store, runner, tmp_path):
    import json

    import torch

    import gradtrace

    out = tmp_path / "self.json"
    result = invoke(runner, "self-influence", store, "--normalize", "length", "--top", 3, "--out", out)
    train = gradtrace.GradientStore.open(store)
    want = gradtrace.Attributor("grad_dot", train).self_scores(normalize="length")
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == [train.ids[i] for i in want.argsort(descending=True).tolist()]
    # the same float32 computation on the same store in this process, written through JSON's doubles (exact for
    # float32 values): equal up to a last-bit difference should the blocks be summed in another order
    torch.testing.assert_close(torch.tensor([r["self_influence"] for r in rows]), want.sort(descending=True).values,
                               rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    raw = gradtrace.Attributor("grad_dot", train).self_scores()
    counts = torch.tensor([r["num_targets"] for r in rows], dtype=torch.float32)
    by_id = dict(zip(train.ids, raw.tolist()))
    # the same raw self-scores divided by an exact integer square on each side: one float32 rounding each, so the
    # two agree to 2 eps (2.4e-7) relative on any CPU, thread count or BLAS; 1e-6 leaves room for a last-bit
    # difference in the raw sums should their blocks be summed in another order
    torch.testing.assert_close(torch.tensor([r["self_influence"] for r in rows]),
                               torch.tensor([by_id[r["id"]] for r in rows]) / counts**2, rtol=1e-6, atol=0)
    text = flat(result.output)
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in ws.train.read_text().splitlines()}
    assert f"1 {rows[0]['self_influence']:.4g} {rows[0]['id']} {' '.join(texts[rows[0]['id']].split())[:70]}" in text
    result = invoke(runner, "self-influence", store, "--method", "ekfac", code=2)
    assert "--curvature" in error_line(result)
