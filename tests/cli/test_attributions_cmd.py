"""``gradtrace score --modules`` / ``--tokens``: pair attributions saved with the scores, read by the report."""

from __future__ import annotations

import json
import shutil

import gradtrace
from gradtrace.options.data import ReadOptions
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


def _sum_ok(parts: list[float], total: float) -> bool:
    """The report's rule: float32 summation error of ``n`` parts."""
    return abs(sum(parts) - total) <= 4 * EPS32 * max(len(parts), 1) * (sum(map(abs, parts)) + abs(total)) + 1e-30


def test_score_tokens_saved_and_reported(ws, runner, store, fresh):
    import gradtrace.data as gd
    from gradtrace.cli.load_model import load_tokenizer

    out = fresh / "scores"
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", out, "--topk", 2, "--tokens",
           "--modules", "--no-progress")
    scores = gradtrace.Scores.load(out)
    tokenizer = load_tokenizer(ws.model)
    train = gd.load(ws.train, tokenizer, read_options=ReadOptions(max_length=48))
    queries = gd.load(ws.queries, tokenizer, read_options=ReadOptions(max_length=48))
    top, bottom = scores.topk(2), scores.topk(2, largest=False)
    for q, qid in enumerate(scores.query_ids):
        for tid, value in zip(top.ids[q] + bottom.ids[q], top.values[q].tolist() + bottom.values[q].tolist()):
            record = scores.tokens(qid, tid)
            for side, data, ident in (("query", queries, qid), ("train", train, tid)):
                ids = data.example(data.ids.index(ident))[0].tolist()
                assert record[f"{side}_tokens"] == [tokenizer.decode([t]) for t in ids]
                assert len(record[f"{side}_scores"]) == len(ids)
                assert _sum_ok(record[f"{side}_scores"], value), (side, qid, tid)
    for record in scores.meta["tokens"]:  # the loss tokens, which the report marks: the data's own mask
        for side, data, ident in (("query", queries, record["query_id"]), ("train", train, record["train_id"])):
            assert record[f"{side}_in_loss"] == data.example(data.ids.index(ident))[1].tolist()
    invoke(runner, "report", out, "--out", fresh / "r.html", "--k", 2)
    html = (fresh / "r.html").read_text(encoding="utf-8")
    assert html.count('class="heat"') >= len(scores.query_ids) * 4  # every training row and query drawn as heat


def test_tokens_bad_input(ws, runner, store, fresh):
    copy = shutil.copytree(store, fresh / "store")
    manifest = copy / "manifest.json"
    info = json.loads(manifest.read_text())
    moved = fresh / "gone.jsonl"
    info["config"]["data"] = str(moved)
    manifest.write_text(json.dumps(info))
    result = invoke(runner, "score", copy, ws.queries, "--model", ws.model, "--out", fresh / "s", "--tokens",
                    "--no-progress", code=2)
    line = error_line(result)
    assert "--tokens" in line and str(moved) in line and "no longer exists" in line
    lines = ws.train.read_text().splitlines()
    moved.write_text("\n".join(lines[:2]) + "\n")  # the data changed: its size is not the recorded one
    result = invoke(runner, "score", copy, ws.queries, "--model", ws.model, "--out", fresh / "s2", "--tokens",
                    "--topk", 3, "--no-progress", code=2)
    line = error_line(result)
    assert "--tokens" in line and str(moved) in line and "changed since" in line
    del info["config"]["gradtrace"]["data"]  # a store that records no fingerprint: the ids still tell
    manifest.write_text(json.dumps(info))
    result = invoke(runner, "score", copy, ws.queries, "--model", ws.model, "--out", fresh / "s2", "--tokens",
                    "--topk", 3, "--no-progress", code=2)
    line = error_line(result)
    assert "are not in" in line and str(moved) in line and "data changed" in line
