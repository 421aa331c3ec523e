"""The command line builds the Python API's option objects (gradtrace.options) instead of mirroring them."""

from __future__ import annotations

from gradtrace import LoGra
from gradtrace.cli.fit import CurvatureOptions
from gradtrace.options import CaptureOptions, FitOptions, Loss, StoreOptions, record
from gradtrace.store import GradientStore
from tests.cli.conftest import invoke


def test_collect_builds_and_records_the_python_api_objects(ws, runner, fresh):
    out = fresh / "s"
    invoke(runner, "collect", ws.model, ws.train, "--out", out, "--rank", 4, "--seed", 2, "--dtype", "int8",
           "--shard-rows", 3, "--no-progress")
    recorded = GradientStore.open(out).manifest["config"]["gradtrace"]["options"]
    assert recorded == {"capture": record(CaptureOptions(projection=LoGra(rank=4, seed=2))),
                        "store": record(StoreOptions(dtype="int8", shard_rows=3)), "loss": record(Loss())}


def test_fit_options_of_the_command_line():
    options = CurvatureOptions(out=None, method="ggn", fisher="true", samples=2, seed=5, damping=0.2)
    assert options.fit_options() == FitOptions(kind="fisher", fisher="true", samples=2, seed=5, damping=0.2)
    assert CurvatureOptions(out=None).fit_options() == FitOptions(kind="ekfac", fisher="auto")


def test_index_score_and_report_options_of_the_command_line():
    """gradtrace index, score --index and report build the Python API's IndexOptions, SearchOptions and
    ReportOptions; --kind auto is the command's default (IndexOptions' is flat)."""
    from pathlib import Path

    from gradtrace.cli.index import BuildOptions
    from gradtrace.cli.report import ReportCommand
    from gradtrace.cli.score import ScoringOptions
    from gradtrace.options.index import IndexOptions, SearchOptions
    from gradtrace.options.report import ReportOptions

    assert BuildOptions().index_options() == IndexOptions(kind="auto")
    built = BuildOptions(kind="ivfpq", nlist=8, m=4, nbits=6, train_rows=100, seed=3, normalize=True)
    assert built.index_options() == IndexOptions(kind="ivfpq", nlist=8, m=4, nbits=6, train_rows=100, seed=3,
                                                 normalize=True)
    scoring = ScoringOptions(out=Path("s"), topk=7, rerank=70, bottom=False, nprobe=3, bottom_nprobe=9, norm_rows=5)
    assert scoring.search_options() == SearchOptions(topk=7, rerank=70, bottom=False, nprobe=3, bottom_nprobe=9,
                                                     norm_rows=5)
    command = ReportCommand(scores=Path("s"), text_options=None, k=2, per_page=3, max_chars=40, self_k=6)
    assert command.report_options() == ReportOptions(k=2, per_page=3, max_chars=40, self_k=6)
    assert ReportCommand(scores=Path("s"), text_options=None).report_options() == ReportOptions()
