"""Ensembles on the command line: further --store with a single-checkpoint method (gradtrace.cli.ensemble)."""

from __future__ import annotations

import torch

import gradtrace
from tests.cli.conftest import invoke


def _normalized(scores):
    return scores.matrix / scores.matrix.abs().mean()


def test_ensemble_is_the_weighted_sum_of_normalized_member_scores(ws, runner, store, fresh):
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--batch-size", 5, "--no-progress")
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--store", store2, "--model", ws.model2,
           "--ensemble-weights", 3, "--ensemble-weights", 1, "--out", fresh / "ens", "--no-progress")
    for name, model_dir, source in (("one", ws.model, store), ("two", ws.model2, store2)):
        invoke(runner, "score", source, ws.queries, "--model", model_dir, "--out", fresh / name, "--no-progress")
    ens = gradtrace.Scores.load(fresh / "ens")
    one, two = gradtrace.Scores.load(fresh / "one"), gradtrace.Scores.load(fresh / "two")
    assert ens.meta["ensemble"]["members"] == 2 and ens.meta["ensemble"]["weights"] == [0.75, 0.25]
    want = 0.75 * _normalized(one) + 0.25 * _normalized(two)
    torch.testing.assert_close(ens.matrix, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_ensemble_of_a_curvature_method_takes_a_curvature_per_member(ws, runner, store, fresh):
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--batch-size", 5, "--no-progress")
    curvatures = []
    for name, model_dir, source in (("c1", ws.model, store), ("c2", ws.model2, store2)):
        invoke(runner, "fit", source, ws.train, "--model", model_dir, "--method", "kfac", "--fisher", "empirical",
               "--out", fresh / name, "--no-progress")
        curvatures.append(fresh / name)
    result = invoke(runner, "score", store, ws.queries, "--method", "kfac", "--store", store2, "--model", ws.model,
                    "--model", ws.model2, "--curvature", curvatures[0], "--out", fresh / "bad", "--no-progress", code=2)
    assert "--member-curvature" in " ".join(result.output.split())
    invoke(runner, "score", store, ws.queries, "--method", "kfac", "--store", store2, "--model", ws.model, "--model",
           ws.model2, "--curvature", curvatures[0], "--member-curvature", curvatures[1], "--out", fresh / "ens",
           "--no-progress")
    members = []
    for name, model_dir, source, curvature in (("one", ws.model, store, curvatures[0]),
                                               ("two", ws.model2, store2, curvatures[1])):
        invoke(runner, "score", source, ws.queries, "--method", "kfac", "--model", model_dir, "--curvature",
               curvature, "--out", fresh / name, "--no-progress")
        members.append(gradtrace.Scores.load(fresh / name))
    want = 0.5 * _normalized(members[0]) + 0.5 * _normalized(members[1])
    got = gradtrace.Scores.load(fresh / "ens").matrix
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_ensemble_flags_are_checked(ws, runner, store, fresh):
    result = invoke(runner, "score", store, ws.queries, "--ensemble-weights", 1, "--out", fresh / "s",
                    "--no-progress", code=2)
    assert "apply to an ensemble" in " ".join(result.output.split())
    result = invoke(runner, "score", store, ws.queries, "--store", store, "--ensemble-weights", 1,
                    "--out", fresh / "s", "--no-progress", code=2)
    assert "1 --ensemble-weights for 2 stores" in " ".join(result.output.split())
