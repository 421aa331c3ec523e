"""gradtrace fit -> gradtrace score --method ekfac --curvature: equal to the Python API; clear errors."""

from __future__ import annotations

import json

import pytest
import torch

import gradtrace
from gradtrace.fit.curvature import Curvature, fit_curvature
from gradtrace.options import CaptureOptions, FitOptions
from tests.cli.conftest import error_line, invoke
from tests.cli.test_pipeline import _api_batches, _model


@pytest.mark.parametrize("method", ["ekfac", "logra"])
def test_fit_then_score_matches_python_api(ws, store, runner, tmp_path, method):
    curvature_dir = tmp_path / "curv"
    args = ["fit", store, ws.train, "--method", method, "--fisher", "empirical", "--out", curvature_dir,
            "--batch-size", 5, "--no-progress"]
    if method == "logra":
        args.remove(ws.train)
    invoke(runner, *args)
    assert (curvature_dir / "curvature.json").exists() and (curvature_dir / "gradtrace-fit.yaml").exists()
    invoke(runner, "score", store, ws.queries, "--method", method, "--curvature", curvature_dir, "--out",
           tmp_path / "scores", "--no-progress")
    scores = gradtrace.Scores.load(tmp_path / "scores")
    train = gradtrace.GradientStore.open(store)
    queries = [line for line in ws.queries.read_text().splitlines() if line.strip()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, queries, ["x"] * 3, 8)]
    query_set = gradtrace.collect(_model(ws.model), batches,
                                  options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    attr = gradtrace.Attributor(method, train, curvature=Curvature.load(curvature_dir))
    expected = attr.score(query_set)
    scale = float(expected.matrix.abs().max())
    torch.testing.assert_close(scores.matrix, expected.matrix, rtol=1e-3, atol=1e-3 * scale)
    assert Curvature.load(curvature_dir).spec.params == train.spec.params
    # re-damping at scoring time changes the scores without a refit
    invoke(runner, "score", store, ws.queries, "--method", method, "--curvature", curvature_dir, "--damping", 10,
           "--out", tmp_path / "scores10", "--no-progress")
    assert not torch.allclose(gradtrace.Scores.load(tmp_path / "scores10").matrix, scores.matrix)


def test_fit_and_score_errors(ws, store, runner, tmp_path):
    result = invoke(runner, "score", store, ws.queries, "--method", "ekfac", "--out", tmp_path / "s", code=2)
    assert "gradtrace fit" in error_line(result)
    result = invoke(runner, "score", store, ws.queries, "--curvature", tmp_path, "--out", tmp_path / "s", code=2)
    assert "apply to methods fitted with gradtrace fit" in error_line(result)
    result = invoke(runner, "fit", store, "--method", "ekfac", "--out", tmp_path / "c", code=2)
    assert "give DATA" in error_line(result)
    result = invoke(runner, "score", store, ws.queries, "--method", "kfac", "--curvature", tmp_path, "--out",
                    tmp_path / "s", code=2)
    assert "curvature.json missing" in error_line(result)
    result = invoke(runner, "fit", store, "--method", "logra", "--fisher", "true", "--out", tmp_path / "c", code=2)
    assert "mode 'dense'" in error_line(result) and not (tmp_path / "c" / "curvature.json").exists()


def test_cli_fit_records_the_fisher_auto_chose(ws, store, runner, tmp_path):
    invoke(runner, "fit", store, ws.train, "--method", "kfac", "--out", tmp_path / "c", "--batch-size", 5,
           "--no-progress")
    assert Curvature.load(tmp_path / "c").fisher == "true"  # a language model: labels sampled from it


def test_fit_curvature_python_matches_cli_fit(ws, store, runner, tmp_path):
    invoke(runner, "fit", store, ws.train, "--method", "kfac", "--fisher", "empirical", "--out", tmp_path / "c",
           "--batch-size", 5, "--no-progress")
    saved = Curvature.load(tmp_path / "c")
    texts = [json.loads(line)["text"] for line in ws.train.read_text().splitlines() if line.strip()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, texts, ["x"] * len(texts), 5)]
    train = gradtrace.GradientStore.open(store)
    fitted = fit_curvature(_model(ws.model), batches, spec=train.spec,
                           fit_options=FitOptions(kind="kfac", fisher="empirical"))
    for name, eig in fitted.blocks.items():
        torch.testing.assert_close(saved.blocks[name].eigenvalues, eig.eigenvalues, rtol=1e-3, atol=1e-6)
