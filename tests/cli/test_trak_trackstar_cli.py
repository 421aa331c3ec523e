"""gradtrace fit --method trak|trackstar -> gradtrace score --fit FIT: TRAK against its formula computed densely in
float64 from the stored rows, TrackStar against the Python API; ensembles over stores; clear errors."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.fit.methods import load_fit
from gradtrace.options import CaptureOptions
from tests.cli.conftest import error_line, invoke
from tests.cli.test_ensemble_cli import _normalized
from tests.cli.test_pipeline import _api_batches, _model


def _queries(ws, model_dir):
    """The queries' gradients as the CLI takes them (the tokenizer's batches of 8, LoGra rank 4, seed 0)."""
    texts = [line for line in ws.queries.read_text().splitlines() if line.strip()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, texts, ["x"] * 3, 8)]
    return gradtrace.collect(_model(model_dir), batches,
                             options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))


def _optimizer_dir(model_dir, texts, out):
    """A Trainer-style checkpoint directory with optimizer.pt: Adam's state after 3 steps at learning rate 0 (the
    weights stay those of ``model_dir``, the second moment is that of real gradients)."""
    model = _model(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.99))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    for start in range(0, 12, 4):
        enc = tokenizer(texts[start:start + 4], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        optimizer.zero_grad()
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
    out.mkdir()
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    return out, optimizer.state_dict()


def _grouped_optimizer_dir(model_dir, texts, out):
    """A checkpoint directory as the Trainer saves one: Adam over two weight-decay groups (matrices, then the rest:
    not the model's order), with or without the parameter names GradtraceCallback writes beside optimizer.pt."""
    model = _model(model_dir)
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    rest = [(n, p) for n, p in named if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": [p for _, p in decay], "weight_decay": 0.01},
                                   {"params": [p for _, p in rest], "weight_decay": 0.0}], lr=0.0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    enc = tokenizer(texts[:4], padding=True, return_tensors="pt")
    model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)).loss.backward()
    optimizer.step()
    out.mkdir()
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    return out, optimizer.state_dict(), [n for n, _ in decay + rest]


@pytest.fixture(scope="module")
def adam(ws, tmp_path_factory):
    return _optimizer_dir(ws.model, ws.lines[:12], tmp_path_factory.mktemp("adam") / "checkpoint-3")


def test_trak_fit_and_score_equal_the_dense_formula(ws, store, runner, tmp_path):
    invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "fit", "--no-progress")
    assert (tmp_path / "fit" / "fit.json").exists() and (tmp_path / "fit" / "gradtrace-fit.yaml").exists()
    invoke(runner, "score", store, ws.queries, "--method", "trak", "--fit", tmp_path / "fit", "--matrix", "yes",
           "--out", tmp_path / "scores", "--no-progress")
    got = gradtrace.Scores.load(tmp_path / "scores").matrix.double()
    rows = gradtrace.GradientStore.open(store).read(0, 24).double()  # [N, D], the stored training gradients
    kernel = rows.t() @ rows  # no 1 - p weights: a causal LM
    lam = 0.1 * float(torch.linalg.eigvalsh(kernel).clamp(min=0).mean())
    queries = _queries(ws, ws.model).vectors.double()
    want = queries @ torch.linalg.solve(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64), rows.t())
    # the queries' float32 gradients, taken by the CLI and by the test in separate passes, meet a preconditioner of
    # condition number up to 1 + D / 0.1 (N < D: most of the kernel is lambda): 1e-3 of the largest score
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * scale)
    fit = load_fit(tmp_path / "fit", "trak")
    assert fit.reweighted is False and fit.examples == 24
    assert fit.mode_used == "dual" and rows.shape[1] > 24  # auto: fewer examples than dimensions
    import json

    shown = json.loads(invoke(runner, "inspect", tmp_path / "fit", "--json").output)
    assert (shown["kind"], shown["method"], shown["options"]["mode_used"], shown["dim"]) == \
        ("method fit", "trak", "dual", rows.shape[1])
    assert shown["rows"]["digest"] and shown["meta"]["config"]["method"] == "trak"
    # the primal kernel gives the same scores
    invoke(runner, "fit", store, "--method", "trak", "--mode", "primal", "--out", tmp_path / "primal", "--no-progress")
    assert load_fit(tmp_path / "primal").mode_used == "primal"
    invoke(runner, "score", store, ws.queries, "--method", "trak", "--fit", tmp_path / "primal", "--matrix", "yes",
           "--out", tmp_path / "scores-primal", "--no-progress")
    torch.testing.assert_close(gradtrace.Scores.load(tmp_path / "scores-primal").matrix.double(), got, rtol=0,
                               atol=1e-4 * scale)
    assert fit.meta["config"]["method"] == "trak" and fit.meta["config"]["gradtrace"]["command"] == "fit"
    # damping changed at scoring, no refit
    invoke(runner, "score", store, ws.queries, "--method", "trak", "--fit", tmp_path / "fit", "--damping", 1.0,
           "--matrix", "yes", "--out", tmp_path / "scores1", "--no-progress")
    lam = 10 * lam
    want = queries @ torch.linalg.solve(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64), rows.t())
    torch.testing.assert_close(gradtrace.Scores.load(tmp_path / "scores1").matrix.double(), want, rtol=1e-3,
                               atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("precondition", ["none", "autocorrelation", "parameter", "curvature"])
def test_trackstar_fit_and_score_equal_the_python_api(ws, store, runner, tmp_path, adam, precondition):
    checkpoint, state = adam
    args = ["fit", store, "--method", "trackstar", "--optimizer", checkpoint, "--out", tmp_path / "fit",
            "--no-progress"]
    python_precondition, structure = None, "joint"
    if precondition in ("autocorrelation", "parameter"):
        args += ["--precondition", "autocorrelation"]
        python_precondition = "autocorrelation"
        if precondition == "parameter":
            args += ["--structure", "parameter"]
            structure = "parameter"
    elif precondition == "curvature":
        invoke(runner, "fit", store, "--method", "logra", "--out", tmp_path / "logra", "--no-progress")
        args += ["--precondition-curvature", tmp_path / "logra"]
        python_precondition = gradtrace.fit.methods.get_method("logra", curvature=tmp_path / "logra")
    invoke(runner, *args)
    assert (tmp_path / "fit" / "precondition" / "curvature.json").exists() == (precondition == "curvature")
    invoke(runner, "score", store, ws.queries, "--method", "trackstar", "--fit", tmp_path / "fit", "--matrix", "yes",
           "--out", tmp_path / "scores", "--no-progress")
    got = gradtrace.Scores.load(tmp_path / "scores").matrix
    train = gradtrace.GradientStore.open(store)
    attr = gradtrace.Attributor("trackstar", train, precondition=python_precondition, structure=structure)
    attr.fit(_model(ws.model), optimizer=state)
    assert gradtrace.load_fit(tmp_path / "fit").options() == attr.method.options()
    want = attr.score(_queries(ws, ws.model), matrix=True).matrix
    # cosines in [-1, 1] from float32 query gradients taken in two passes (see the trak test for the preconditioned)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert float(got.abs().max()) <= 1 + 1e-5


@pytest.mark.parametrize("method", ["trak", "trackstar"])
def test_an_ensemble_of_fitted_methods_takes_a_fit_per_member(ws, store, runner, fresh, adam, method):
    store2 = fresh / "store2"
    invoke(runner, "collect", ws.model2, ws.train, "--out", store2, "--rank", 4, "--batch-size", 5, "--no-progress")
    fits = []
    for name, model_dir, source in (("f1", ws.model, store), ("f2", ws.model2, store2)):
        extra = []
        if method == "trackstar":
            checkpoint = adam[0] if model_dir == ws.model else \
                _optimizer_dir(ws.model2, ws.lines[:12], fresh / "checkpoint-2")[0]
            extra = ["--optimizer", checkpoint]
        invoke(runner, "fit", source, "--model", model_dir, "--method", method, "--out", fresh / name, *extra,
               "--no-progress")
        fits.append(fresh / name)
    result = invoke(runner, "score", store, ws.queries, "--method", method, "--store", store2, "--model", ws.model,
                    "--model", ws.model2, "--fit", fits[0], "--out", fresh / "bad", "--no-progress", code=2)
    assert "one --member-curvature per further --store (1)" in error_line(result)
    invoke(runner, "score", store, ws.queries, "--method", method, "--store", store2, "--model", ws.model, "--model",
           ws.model2, "--fit", fits[0], "--member-fit", fits[1], "--matrix", "yes", "--out", fresh / "ens",
           "--no-progress")
    members = []
    for name, model_dir, source, fit in (("one", ws.model, store, fits[0]), ("two", ws.model2, store2, fits[1])):
        invoke(runner, "score", source, ws.queries, "--method", method, "--model", model_dir, "--fit", fit,
               "--matrix", "yes", "--out", fresh / name, "--no-progress")
        members.append(gradtrace.Scores.load(fresh / name))
    want = 0.5 * _normalized(members[0]) + 0.5 * _normalized(members[1])
    ensemble = gradtrace.Scores.load(fresh / "ens")
    assert ensemble.meta["ensemble"]["members"] == 2
    torch.testing.assert_close(ensemble.matrix, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_trak_and_trackstar_errors_name_the_fix(ws, store, runner, tmp_path, adam):
    def error(*args):
        return error_line(invoke(runner, *args, "--no-progress", code=2))

    assert "drop DATA" in error("fit", store, ws.train, "--method", "trak", "--out", tmp_path / "f")
    assert "--mode applies to trak" in error("fit", store, "--method", "logra", "--mode", "dual", "--out",
                                             tmp_path / "f")
    assert "trak's Gram matrix of store" in error("fit", store, "--method", "trak", "--max-dim", 10, "--out",
                                                   tmp_path / "f")
    assert "--optimizer applies to --method trackstar, not trak" in error(
        "fit", store, "--method", "trak", "--optimizer", adam[0], "--out", tmp_path / "f")
    assert "--max-dim applies to trak and trackstar" in error(
        "fit", store, ws.train, "--method", "kfac", "--max-dim", 9, "--out", tmp_path / "f")
    assert "pass --optimizer OPTIMIZER" in error("fit", store, "--method", "trackstar", "--out", tmp_path / "f")
    assert "--structure applies to --method trackstar --precondition autocorrelation" in error(
        "fit", store, "--method", "trackstar", "--optimizer", adam[0], "--structure", "parameter", "--out",
        tmp_path / "f")
    assert "or --structure parameter" in error("fit", store, "--method", "trackstar", "--optimizer", adam[0],
                                               "--precondition", "autocorrelation", "--max-dim", 10, "--out",
                                               tmp_path / "f")
    assert "choose one" in error("fit", store, "--method", "trackstar", "--optimizer", adam[0], "--precondition",
                                 "autocorrelation", "--precondition-curvature", tmp_path, "--out", tmp_path / "f")
    other = tmp_path / "other-store"
    invoke(runner, "collect", ws.model, ws.train, "--out", other, "--rank", 2, "--batch-size", 5, "--no-progress")
    invoke(runner, "fit", other, "--method", "logra", "--out", tmp_path / "other-logra", "--no-progress")
    assert "--precondition-curvature" in error("fit", store, "--method", "trackstar", "--optimizer", adam[0],
                                               "--precondition-curvature", tmp_path / "other-logra", "--out",
                                               tmp_path / "f")
    assert "no optimizer state at" in error("fit", store, "--method", "trackstar", "--optimizer", tmp_path,
                                            "--out", tmp_path / "f")
    assert not (tmp_path / "f" / "fit.json").exists()
    assert "gradtrace fit" in error("score", store, ws.queries, "--method", "trak", "--out", tmp_path / "s")
    invoke(runner, "fit", store, "--method", "logra", "--out", tmp_path / "logra", "--no-progress")
    assert "it holds curvature.json, the fit of another method" in error(
        "score", store, ws.queries, "--method", "trak", "--fit", tmp_path / "logra", "--out", tmp_path / "s")
    invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "trak", "--no-progress")
    assert "holds a trak fit, not a trackstar one" in error(
        "score", store, ws.queries, "--method", "trackstar", "--fit", tmp_path / "trak", "--out", tmp_path / "s")
    assert "already holds a fitted method" in error("fit", store, "--method", "trak", "--out", tmp_path / "trak")
    invoke(runner, "fit", store, "--method", "trackstar", "--optimizer", adam[0], "--out", tmp_path / "ts",
           "--no-progress")
    assert "no preconditioner, so there is no damping" in error(
        "score", store, ws.queries, "--method", "trackstar", "--fit", tmp_path / "ts", "--damping", 1,
        "--out", tmp_path / "s")
    invoke(runner, "index", store, "--out", tmp_path / "index", "--kind", "flat", "--no-progress")
    assert "transforms the training rows" in error(
        "score", store, ws.queries, "--method", "trackstar", "--fit", tmp_path / "ts", "--index", tmp_path / "index",
        "--topk", 2, "--out", tmp_path / "s")
    # the plan of a fit, and --dry-run writes nothing
    result = invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "dry", "--dry-run",
                    "--no-progress")
    assert "Plan: trak fit (dual: the N x N Gram matrix" in result.output and "over 24 stored rows" in result.output
    assert not (tmp_path / "dry").exists()


def test_trackstar_maps_a_grouped_checkpoint_state_by_the_names_saved_beside_it(ws, store, runner, tmp_path):
    """The Trainer's weight-decay groups list parameters out of the model's order: the names GradtraceCallback saves
    beside optimizer.pt map them (equal to the Python API given the names); without them the fit is refused."""
    import json

    from gradtrace.common.checkpoints import OPTIMIZER_NAMES_FILE

    checkpoint, state, names = _grouped_optimizer_dir(ws.model, ws.lines, tmp_path / "checkpoint-1")
    result = invoke(runner, "fit", store, "--method", "trackstar", "--optimizer", checkpoint, "--out",
                    tmp_path / "bare", "--no-progress", code=2)
    assert "2 parameter groups and records no parameter names" in error_line(result)
    assert "gradtrace-optimizer.json" in " ".join(result.output.split())
    (checkpoint / OPTIMIZER_NAMES_FILE).write_text(json.dumps({"optimizer_parameters": names}))
    invoke(runner, "fit", store, "--method", "trackstar", "--optimizer", checkpoint, "--out", tmp_path / "fit",
           "--no-progress")
    invoke(runner, "score", store, ws.queries, "--method", "trackstar", "--fit", tmp_path / "fit", "--matrix", "yes",
           "--out", tmp_path / "scores", "--no-progress")
    train = gradtrace.GradientStore.open(store)
    want = gradtrace.Attributor("trackstar", train).fit(_model(ws.model), optimizer=state, param_names=names)
    # the second moment mapped into the LoGra projection, (P_rows^2) V (P_cols^2)^T, is a float32 sum of nonnegative
    # terms computed twice (CLI, Python): relative error <= (rows + cols) eps32 each, halved by the square root
    longest = max(sum(p.shape) for p in _model(ws.model).parameters())
    torch.testing.assert_close(load_fit(tmp_path / "fit").denominator, want.method.denominator,
                               rtol=longest * torch.finfo(torch.float32).eps, atol=0)
    got = gradtrace.Scores.load(tmp_path / "scores").matrix
    torch.testing.assert_close(got, want.score(_queries(ws, ws.model), matrix=True).matrix, rtol=0, atol=1e-3)


def test_a_kernel_fit_beyond_the_available_memory_is_refused_unless_forced(ws, store, runner, tmp_path, monkeypatch):
    import sys

    # the module (gradtrace.plan is also the name of the function it exports)
    monkeypatch.setattr(sys.modules["gradtrace.plan.fit_plan"], "available_memory", lambda device=None: 1000)
    result = invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "f", "--no-progress", code=2)
    assert "of memory at its peak but 1000 B is available" in error_line(result)
    assert "memory      about" in result.output and not (tmp_path / "f").exists()
    invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "f", "--force", "--no-progress")
    assert (tmp_path / "f" / "fit.json").exists()


def test_trak_self_influence_is_the_leverage_of_each_stored_row(ws, store, runner, tmp_path):
    invoke(runner, "fit", store, "--method", "trak", "--out", tmp_path / "fit", "--no-progress")
    out = tmp_path / "self.json"
    invoke(runner, "self-influence", store, "--method", "trak", "--fit", tmp_path / "fit", "--out", out)
    import json

    rows = json.loads(out.read_text())
    got = torch.tensor([r["self_influence"] for r in rows], dtype=torch.float64)
    stored = gradtrace.GradientStore.open(store)
    grads = stored.read(0, 24).double()
    kernel = grads.t() @ grads
    lam = 0.1 * float(torch.linalg.eigvalsh(kernel).clamp(min=0).mean())
    leverage = (grads * torch.linalg.solve(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64),
                                           grads.t()).t()).sum(1)
    order = [stored.ids.index(r["id"]) for r in rows]
    # float32 products of D terms after a float64 preconditioning: 1e-4 of the largest leverage (each is below 1)
    torch.testing.assert_close(got, leverage[order], rtol=0, atol=1e-4 * float(leverage.max()))
    assert float(leverage.max()) < 1 and got.tolist() == sorted(got.tolist(), reverse=True)
    line = error_line(invoke(runner, "self-influence", store, "--method", "trak", code=2))
    assert "gradtrace fit" in line and "--method trak" in line
