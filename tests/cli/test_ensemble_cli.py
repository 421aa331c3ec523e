"""Ensembles on the command line: further --store with a single-checkpoint method (gradtrace.cli.ensemble)."""

from __future__ import annotations

import torch
import yaml

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
    listed = " ".join(invoke(runner, "topk", fresh / "ens", "--k", 1).output.split())
    assert ("Combines: ensemble of 2 members (weights 0.75, 0.25; each member's scores divided by their mean "
            "|score|).") in listed
    shown = " ".join(invoke(runner, "inspect", fresh / "ens").output.split())
    assert "combines ensemble of 2 members (weights 0.75, 0.25;" in shown
    want = 0.75 * _normalized(one) + 0.25 * _normalized(two)
    torch.testing.assert_close(ens.matrix, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def _kfac_members(ws, runner, store, fresh):
    """A second member (ws.model2's store) and each member's kfac fit: ``(store2, [fit of store, fit of store2])``."""
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--batch-size", 5, "--no-progress")
    fits = []
    for name, model_dir, source in (("c1", ws.model, store), ("c2", ws.model2, store2)):
        invoke(runner, "fit", source, ws.train, "--model", model_dir, "--method", "kfac", "--fisher", "empirical",
               "--out", fresh / name, "--no-progress")
        fits.append(fresh / name)
    return store2, fits


def test_ensemble_of_a_curvature_method_takes_a_curvature_per_member(ws, runner, store, fresh):
    store2, curvatures = _kfac_members(ws, runner, store, fresh)
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


def test_an_ensembles_resolved_config_replays_it_from_anywhere(ws, runner, store, fresh, monkeypatch):
    """Every path of the resolved configuration -- the further stores and each member's fit too -- is recorded
    relative to the scores' folder, so ``score --config`` repeats the ensemble from another working directory."""
    project = fresh / "project"
    project.mkdir()
    monkeypatch.chdir(project)  # every path below is given relative to it
    invoke(runner, "collect", ws.model2, ws.train, "--out", "store2", "--rank", 4, "--batch-size", 5, "--no-progress")
    for name, model_dir, source in (("c1", ws.model, store), ("c2", ws.model2, "store2")):
        invoke(runner, "fit", source, ws.train, "--model", model_dir, "--method", "kfac", "--fisher", "empirical",
               "--out", name, "--no-progress")
    invoke(runner, "score", store, ws.queries, "--method", "kfac", "--store", "store2", "--model", ws.model,
           "--model", ws.model2, "--curvature", "c1", "--member-curvature", "c2", "--out", "ens", "--no-progress")
    recorded = yaml.safe_load((project / "ens" / "gradtrace-score.yaml").read_text())
    assert (recorded["checkpoint_stores"], recorded["curvature"], recorded["member_curvature"]) == (
        ["../store2"], "../c1", ["../c2"])
    monkeypatch.chdir(fresh)  # elsewhere: the recorded paths are read against the file's folder
    invoke(runner, "score", "--config", project / "ens" / "gradtrace-score.yaml", "--overwrite", "--no-progress")
    first = gradtrace.Scores.load(project / "ens")  # replaced by the repeat
    invoke(runner, "score", "--config", project / "ens" / "gradtrace-score.yaml", "--out", fresh / "again",
           "--no-progress")
    again = gradtrace.Scores.load(fresh / "again")
    assert again.meta["ensemble"]["members"] == 2
    # the same computation repeated: equal to float32 round-off of the products (rtol as the tests above)
    torch.testing.assert_close(again.matrix, first.matrix, rtol=1e-4, atol=1e-4 * float(first.matrix.abs().max()))


def test_self_influence_of_an_ensemble_is_the_weighted_sum_of_normalized_members(ws, runner, store, fresh):
    import json

    store2, fits = _kfac_members(ws, runner, store, fresh)

    def self_influence(path, *args):
        invoke(runner, "self-influence", *args, "--out", path)
        return {r["id"]: r["self_influence"] for r in json.loads(path.read_text())}

    members = [self_influence(fresh / f"m{c}.json", source, "--method", "kfac", "--fit", fit)
               for c, (source, fit) in enumerate(zip((store, store2), fits))]
    got = self_influence(fresh / "ens.json", store, "--store", store2, "--method", "kfac", "--fit", fits[0],
                         "--member-fit", fits[1], "--ensemble-weights", 3, "--ensemble-weights", 1)
    ids = sorted(got)
    scales = [sum(abs(v) for v in m.values()) / len(m) for m in members]
    want = torch.tensor([0.75 * members[0][i] / scales[0] + 0.25 * members[1][i] / scales[1] for i in ids])
    # each member's self-influence computed twice (alone, in the ensemble) in float32: the ensemble test's bound
    torch.testing.assert_close(torch.tensor([got[i] for i in ids]), want, rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))
    listed = " ".join(invoke(runner, "self-influence", store, "--store", store2, "--method", "kfac", "--fit",
                             fits[0], "--member-fit", fits[1]).output.split())
    assert "and 1 more store(s), an ensemble" in listed
    result = invoke(runner, "self-influence", store, "--store", store2, "--method", "kfac", "--fit", fits[0], code=2)
    assert "one --member-curvature per further --store" in " ".join(result.output.split())
