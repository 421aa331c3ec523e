"""``gradtrace collect --model A --model B DATA --out DIR``: one store per model, then the printed ensemble command."""

from __future__ import annotations

import json
import shlex
import shutil

import torch

import gradtrace
from gradtrace.common.provenance import resolve_paths
from gradtrace.options import CaptureOptions
from tests.cli.conftest import error_line, flat, invoke
from tests.cli.test_pipeline import _api_batches

COLLECT = ("--rank", 4, "--batch-size", 5, "--no-progress")


def _checkpoints(ws, root):
    """The two model directories as a Trainer run's checkpoints (named after their step)."""
    dirs = [root / "run" / "checkpoint-100", root / "run" / "checkpoint-200"]
    for source, target in zip((ws.model, ws.model2), dirs):
        shutil.copytree(source, target)
    return dirs


def test_one_store_per_model_and_the_printed_ensemble_command(ws, runner, store, fresh):
    dirs = _checkpoints(ws, fresh)
    out = fresh / "stores"
    dry = invoke(runner, "collect", "--model", dirs[0], "--model", dirs[1], ws.train, "--out", out, "--dry-run",
                 *COLLECT)
    assert "2 stores x" in dry.output and "2 models x" in dry.output and not out.exists()
    result = invoke(runner, "collect", "--model", dirs[0], "--model", dirs[1], ws.train, "--out", out, *COLLECT)
    text = flat(result.output)
    assert text.count("Plan:") == 1 and text.count("Stored 24 new examples in") == 2
    stores = [gradtrace.GradientStore.open(out / name) for name in ("checkpoint-100", "checkpoint-200")]
    # each store is what a single-model collect writes (the session's `store`: ws.model, the same options)
    single = gradtrace.GradientStore.open(store)
    assert stores[0].ids == single.ids and torch.equal(stores[0].read(0, 24), single.read(0, 24))
    assert stores[1].spec.model != stores[0].spec.model
    for opened, model_dir in zip(stores, dirs):
        recorded = resolve_paths(json.loads((opened.root / "manifest.json").read_text())["config"], opened.root)
        assert recorded["model"] == str(model_dir)  # what gradtrace score loads by default
    # the printed next command, run as printed (QUERIES and SCORES_DIR filled in): models from the stores, the
    # checkpoints of one run latest first (STORE: the model explained; tests/cli/test_ensemble_generate.py)
    line = next(x for x in result.output.splitlines() if x.startswith("Next: gradtrace score"))
    args = shlex.split(line.removeprefix("Next: gradtrace "))
    assert args == ["score", str(out / "checkpoint-200"), "QUERIES.jsonl", "--store", str(out / "checkpoint-100"),
                    "--out", "SCORES_DIR"]
    args = [str(ws.queries) if a == "QUERIES.jsonl" else str(fresh / "ens") if a == "SCORES_DIR" else a for a in args]
    invoke(runner, *args, "--no-progress")
    got = gradtrace.Scores.load(fresh / "ens")
    queries = [line for line in ws.queries.read_text().splitlines() if line.strip()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, queries, ["x"] * 3, 8)]
    query_sets = gradtrace.collect_checkpoints(dirs, batches,
                                               options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    want = gradtrace.Ensemble("grad_dot", stores).score(query_sets, topk=None)
    assert got.meta["ensemble"]["members"] == 2 and got.query_ids == want.query_ids
    # float32: the CLI pads the queries on another side than the reference batches (summation order only)
    torch.testing.assert_close(got.matrix, want.matrix, rtol=1e-4, atol=1e-4 * float(want.matrix.abs().max()))


def test_resume_and_refusals_apply_per_store(ws, runner, fresh):
    dirs = _checkpoints(ws, fresh)
    out = fresh / "stores"
    invoke(runner, "collect", ws.model, ws.train, "--out", out / "checkpoint-100", *COLLECT)
    base = ["collect", "--model", dirs[0], "--model", dirs[1], ws.train, "--out", out, *COLLECT]
    line = error_line(invoke(runner, *base, code=2))
    assert f"{out / 'checkpoint-100'} already holds a gradient store: pass --resume" in line
    assert not (out / "checkpoint-200").exists()  # refused before any work
    result = invoke(runner, *base, "--resume")
    assert "Stored 0 new examples (24 were already stored)" in flat(result.output)
    assert gradtrace.GradientStore.open(out / "checkpoint-200").complete
    twins = [fresh / "a" / "model", fresh / "b" / "model"]
    for target in twins:
        shutil.copytree(ws.model, target)
    line = error_line(invoke(runner, "collect", "--model", twins[0], "--model", twins[1], ws.train, "--out",
                             fresh / "twins", *COLLECT, code=2))
    assert "store name 'model' would be used for 2 checkpoints" in line and "separate --out" in line
    line = error_line(invoke(runner, "collect", "--model", dirs[0], "--model", dirs[1], ws.train, "--out",
                             out / "checkpoint-100", *COLLECT, code=2))
    assert "is a gradient store; with several --model, --out is the directory" in line
    line = error_line(invoke(runner, "collect", ws.model, "--out", fresh / "x", *COLLECT, code=2))
    assert "give the model and the data" in line
    # a single --model is today's command: --out is the store
    invoke(runner, "collect", "--model", ws.model, ws.train, "--out", fresh / "one", *COLLECT)
    assert gradtrace.GradientStore.open(fresh / "one").complete


def test_checkpoints_of_a_run_directory_in_step_order(ws, runner, fresh):
    """--checkpoints-of RUN_DIR takes its checkpoint-N directories in step order (10 before 100, not by name),
    --last K the last K; --checkpoint is --model by its other name."""
    run = fresh / "run"
    for step, source in ((5, ws.model), (10, ws.model2), (100, ws.model)):
        shutil.copytree(source, run / f"checkpoint-{step}")
    (run / "checkpoint-final").mkdir()  # not a checkpoint-N directory: ignored, as a file would be
    (run / "trainer_state.json").write_text("{}")
    result = invoke(runner, "collect", "--checkpoints-of", run, "--last", 2, ws.train, "--out", fresh / "stores",
                    "--dry-run", *COLLECT)
    assert "2 stores x" in flat(result.output)
    invoke(runner, "collect", "--checkpoint", run / "checkpoint-5", "--checkpoints-of", run, "--last", 2, ws.train,
           "--out", fresh / "stores", *COLLECT)
    assert sorted(p.name for p in (fresh / "stores").iterdir()) == ["checkpoint-10", "checkpoint-100", "checkpoint-5"]
    for name in ("checkpoint-10", "checkpoint-100"):
        recorded = yaml_config(fresh / "stores" / name)
        assert (fresh / "stores" / name / recorded["model"]).resolve() == (run / name).resolve()
        assert "checkpoints_of" not in recorded and "last" not in recorded  # each store records its own model
    assert "--last K takes the last K checkpoints of --checkpoints-of" in error_line(
        invoke(runner, "collect", "--model", run / "checkpoint-5", "--last", 1, ws.train, "--out", fresh / "x",
               *COLLECT, code=2))
    (fresh / "empty").mkdir()
    assert "holds no Trainer checkpoint" in error_line(
        invoke(runner, "collect", "--checkpoints-of", fresh / "empty", ws.train, "--out", fresh / "x", *COLLECT,
               code=2))
    # checkpoint-N directories that are not models (here: stores named after checkpoints) are refused, not skipped
    assert "is not a Hugging Face model directory" in error_line(
        invoke(runner, "collect", "--checkpoints-of", fresh / "stores", ws.train, "--out", fresh / "x", *COLLECT,
               code=2))


def yaml_config(store):
    import yaml

    return yaml.safe_load((store / "gradtrace-collect.yaml").read_text())
