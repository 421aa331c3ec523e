"""TracIn over two checkpoints: one --store/--model/--lr per checkpoint."""

from __future__ import annotations

import torch

import gradtrace
from tests.cli.conftest import invoke


def test_tracin_is_the_lr_weighted_sum_of_checkpoint_scores(ws, runner, store, fresh):
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--batch-size", 5, "--no-progress")
    out = invoke(runner, "score", store, ws.queries, "--method", "tracin", "--model", ws.model, "--lr", 0.5,
                 "--store", store2, "--model", ws.model2, "--lr", 0.25, "--out", fresh / "tracin",
                 "--no-progress").stdout
    assert "tracin" in out
    for name, model_dir, source in (("dot1", ws.model, store), ("dot2", ws.model2, store2)):
        invoke(runner, "score", source, ws.queries, "--model", model_dir, "--out", fresh / name, "--no-progress")
    tracin = gradtrace.Scores.load(fresh / "tracin")
    dot1, dot2 = gradtrace.Scores.load(fresh / "dot1"), gradtrace.Scores.load(fresh / "dot2")
    assert tracin.method == "tracin" and tracin.meta["checkpoints"] == 2
    assert tracin.meta["options"]["weights"] == [0.5, 0.25]
    torch.testing.assert_close(tracin.matrix, 0.5 * dot1.matrix + 0.25 * dot2.matrix, rtol=1e-4, atol=1e-3)


def test_tracin_uses_the_models_recorded_in_the_stores(ws, runner, store, fresh):
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--no-progress")
    invoke(runner, "score", store, ws.queries, "--method", "tracin", "--store", store2, "--lr", 1, "--lr", 1,
           "--out", fresh / "sc", "--no-progress")
    assert gradtrace.Scores.load(fresh / "sc").meta["config"]["model"] == [str(ws.model), str(ws.model2)]


def test_other_weights_warn(ws, runner, store, fresh):
    result = invoke(runner, "score", store, ws.queries, "--model", ws.model2, "--out", fresh / "sc", "--no-progress")
    assert "differ from those of the model that collected" in " ".join(result.output.split())
