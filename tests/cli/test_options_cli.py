"""The command line builds the Python API's option objects (gradtrace.options) instead of mirroring them."""

from __future__ import annotations

from gradtrace import LoGra
from gradtrace.cli.fit import CurvatureOptions
from gradtrace.options import CaptureOptions, FitOptions, StoreOptions, record
from gradtrace.store import GradientStore
from tests.cli.conftest import invoke


def test_collect_builds_and_records_the_python_api_objects(ws, runner, fresh):
    out = fresh / "s"
    invoke(runner, "collect", ws.model, ws.train, "--out", out, "--rank", 4, "--seed", 2, "--dtype", "int8",
           "--shard-rows", 3, "--no-progress")
    recorded = GradientStore.open(out).manifest["config"]["gradtrace"]["options"]
    assert recorded == {"capture": record(CaptureOptions(projection=LoGra(rank=4, seed=2))),
                        "store": record(StoreOptions(dtype="int8", shard_rows=3))}


def test_fit_options_of_the_command_line():
    options = CurvatureOptions(out=None, method="ggn", fisher="true", samples=2, seed=5, damping=0.2)
    assert options.fit_options() == FitOptions(kind="fisher", fisher="true", samples=2, seed=5, damping=0.2)
    assert CurvatureOptions(out=None).fit_options() == FitOptions(kind="ekfac", fisher="auto")
