"""The precision flags of the command line: ``gradtrace fit --covariance-dtype / --eigen-dtype / --offload``,
``gradtrace score --score-dtype``, ``gradtrace collect --grad-dtype``: each reaches the option object it stands for,
is recorded with the artifact and shown by ``gradtrace inspect``; a flag the method does not use is refused."""

from __future__ import annotations

import json

import torch

import gradtrace
from gradtrace.cli.score_queries import recorded_grad_dtype
from gradtrace.fit.curvature import Curvature
from tests.cli.conftest import error_line, flat, invoke


def test_fit_precision_flags_are_recorded_and_shown(ws, store, runner, tmp_path):
    invoke(runner, "fit", store, ws.train, "--method", "kfac", "--fisher", "empirical", "--out", tmp_path / "c",
           "--batch-size", 5, "--covariance-dtype", "float64", "--eigen-dtype", "float32", "--offload",
           "--no-progress")
    fitted = Curvature.load(tmp_path / "c")
    assert fitted.precision() == {"covariance_dtype": "float64", "eigen_dtype": "float32", "offload": True,
                                  "assumed": []}
    shown = flat(invoke(runner, "inspect", tmp_path / "c").stdout)
    assert "statistics float64, eigendecompositions float32, offloaded" in shown
    described = json.loads(invoke(runner, "inspect", tmp_path / "c", "--json").stdout)
    assert described["precision"]["covariance_dtype"] == "float64"
    result = invoke(runner, "fit", store, "--method", "logra", "--offload", "--out", tmp_path / "l", code=2)
    assert "--offload applies to the model-pass fits (kfac, ekfac, ggn), not logra" in error_line(result)


def test_score_dtype_flag(ws, store, runner, tmp_path):
    for dtype in ("float32", "float64"):
        invoke(runner, "score", store, ws.queries, "--out", tmp_path / dtype, "--score-dtype", dtype, "--topk", 3,
               "--no-progress")
    low, high = (gradtrace.Scores.load(tmp_path / d) for d in ("float32", "float64"))
    assert low.matrix.dtype == torch.float32 and high.matrix.dtype == torch.float64
    assert high.meta["gradtrace"]["options"]["score"]["score_dtype"] == "float64"
    scale = float(high.matrix.abs().max())
    torch.testing.assert_close(low.matrix.double(), high.matrix, rtol=1e-5, atol=1e-6 * scale)


def test_grad_dtype_flag(ws, runner, tmp_path):
    result = invoke(runner, "collect", ws.model, ws.train, "--out", tmp_path / "exact", "--projection", "none",
                    "--grad-dtype", "activation", "--no-progress", code=2)
    assert "--grad-dtype sets the dtype of LoGra's projection products" in error_line(result)
    for dtype in ("float32", "activation"):
        invoke(runner, "collect", ws.model, ws.train, "--out", tmp_path / dtype, "--rank", 4, "--batch-size", 5,
               "--grad-dtype", dtype, "--no-progress")
    stores = {d: gradtrace.GradientStore.open(tmp_path / d) for d in ("float32", "activation")}
    assert recorded_grad_dtype(stores["activation"], stores["activation"].spec.projection) == "activation"
    assert recorded_grad_dtype(stores["float32"], stores["float32"].spec.projection) == "float32"
    # a float32 model: the two paths are the same products
    assert torch.equal(stores["float32"].read(0, len(stores["float32"])),
                       stores["activation"].read(0, len(stores["activation"])))
