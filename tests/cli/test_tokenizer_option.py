"""``--tokenizer DIR``: model directories without a tokenizer (a Trainer's checkpoint-N saved without
processing_class). collect records it in the store; score, fit, report and self-influence then read text with it."""

from __future__ import annotations

import json

import torch
import yaml

import gradtrace
from tests.cli.conftest import error_line, invoke


def test_a_model_without_a_tokenizer_takes_one_from_tokenizer(ws, runner, store, fresh):
    # ws.no_tokenizer holds the same weights as ws.model (seed 0) and no tokenizer files
    line = error_line(invoke(runner, "collect", ws.no_tokenizer, ws.train, "--out", fresh / "none", "--rank", 4,
                             "--no-progress", code=2))
    assert "has no tokenizer" in line and "--tokenizer DIR" in line
    invoke(runner, "collect", ws.no_tokenizer, ws.train, "--tokenizer", ws.model, "--out", fresh / "s", "--rank", 4,
           "--batch-size", 5, "--no-progress")
    got, want = gradtrace.GradientStore.open(fresh / "s"), gradtrace.GradientStore.open(store)
    assert got.ids == want.ids  # the same tokenization: content-hash ids of the same tokens
    # the same model, data and batches: the same gradients up to float32 round-off of the two runs' reductions
    torch.testing.assert_close(got.read(0, len(got)), want.read(0, len(want)), rtol=1e-4,
                               atol=1e-5 * float(want.read(0, len(want)).abs().max()))
    recorded = yaml.safe_load((fresh / "s" / "gradtrace-collect.yaml").read_text())
    assert (fresh / "s" / recorded["tokenizer"]).resolve() == ws.model.resolve()

    # no --tokenizer now: every command reads text with the one the store records
    invoke(runner, "score", fresh / "s", ws.queries, "--out", fresh / "scores", "--topk", 3, "--no-progress")
    scores = gradtrace.Scores.load(fresh / "scores")
    assert scores.meta["config"]["tokenizer"] == str(ws.model)
    invoke(runner, "fit", fresh / "s", ws.train, "--method", "kfac", "--fisher", "empirical", "--out",
           fresh / "kfac", "--no-progress")
    invoke(runner, "report", fresh / "scores")
    assert "GradTrace report" in (fresh / "scores" / "report.html").read_text()
    invoke(runner, "self-influence", fresh / "s", "--top", 3, "--out", fresh / "self.json")
    rows = json.loads((fresh / "self.json").read_text())
    assert len(rows) == len(got.ids)
