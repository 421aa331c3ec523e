"""``--eos``: text examples end with EOS as TRL's SFTTrainer tokenizes them; the option is recorded, so topk and
the report find the texts under the content-hash ids it gave (see tests/data/test_eos.py for the library side)."""

from __future__ import annotations

import json

from markupsafe import escape

import gradtrace
import gradtrace.data as gd
from gradtrace.options.data import ReadOptions
from tests.cli.conftest import error_line, invoke


def test_cli_eos_collects_trl_tokens_records_it_and_topk_finds_the_texts(ws, runner, fresh):
    from transformers import AutoTokenizer

    lines = ws.lines[:6]
    data = fresh / "lm.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    out = invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--rank", 2, "--eos", "--no-progress").stdout
    assert "6 examples, text (EOS appended), loss on all" in " ".join(out.split())
    tok = AutoTokenizer.from_pretrained(ws.model)
    store = gradtrace.GradientStore.open(fresh / "s")
    assert store.ids == gd.load(data, tok, read_options=ReadOptions(add_eos=True)).ids != gd.load(data, tok).ids
    assert json.loads((fresh / "s" / "manifest.json").read_text())["config"]["eos"] is True
    invoke(runner, "score", fresh / "s", data, "--model", ws.model, "--out", fresh / "sc", "--topk", 2, "--eos",
           "--no-progress")
    rows = json.loads(invoke(runner, "topk", fresh / "sc", "--data", data, "--queries", data, "--k", 1,
                             "--format", "json").stdout)
    assert {r["train_text"] for r in rows} <= set(lines) and {r["query_text"] for r in rows} == set(lines)
    invoke(runner, "report", fresh / "sc", "--out", fresh / "r.html")  # the texts recorded with the scores
    html = (fresh / "r.html").read_text(encoding="utf-8")
    assert all(str(escape(line)) in html for line in lines)  # every query's text (found under its --eos id)
    line = error_line(invoke(runner, "collect", ws.model, ws.root / "missing.jsonl", "--out", fresh / "x", "--eos",
                             "--no-progress", code=2))
    assert "missing.jsonl" in line
