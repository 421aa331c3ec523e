"""``gradtrace report SCORES_DIR --out report.html``: the scores as one self-contained HTML page.

Texts come from the data the scores record (the training data in the store's manifest, the query file of
``gradtrace score``) unless ``--data``/``--queries`` are given. (The console-output helpers of the commands
live in :mod:`gradtrace.cli.console`; this module is the ``report`` command.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.paths import why_missing
from ..options import report as api
from .commands import QUIET_PROGRESS, api_field, cli, progress_flag
from .console import console, human_bytes
from .errors import CliError
from .groups import TextOptions
from .outputs import check_output_file
from .score import MethodName

__all__ = ["OPTIONS", "ReportCommand", "run"]


@dataclass(kw_only=True)
class ReportCommand:
    """Options of ``gradtrace report``."""

    scores: Path = field(metadata=cli("Directory of saved scores (written by gradtrace score).", argument=True,
                                      metavar="SCORES_DIR"))
    out: Path | None = field(default=None, metadata=cli(
        "HTML file to write (default: SCORES_DIR/report.html).", "--out", "-o", metavar="FILE"))
    overwrite: bool = field(default=False, metadata=cli("Replace the --out file if it exists."))
    text_options: TextOptions
    k: int = field(default=5, metadata=api_field(api.ReportOptions, "k", "--k", "-k"))
    per_page: int = field(default=20, metadata=api_field(api.ReportOptions, "per_page"))
    max_chars: int = field(default=600, metadata=api_field(api.ReportOptions, "max_chars"))
    self_influence: bool = field(default=False, metadata=cli(
        "Add the training examples of highest self-influence (computed from the store the scores record).",
        "--self-influence/--no-self-influence"))
    self_method: MethodName | None = field(default=None, metadata=cli(
        "Method of the self-influence (default: the scores' method; grad_cos gives 1 for every example)."))
    self_k: int = field(default=20, metadata=api_field(api.ReportOptions, "self_k"))
    progress: bool = progress_flag(QUIET_PROGRESS)

    def report_options(self) -> api.ReportOptions:
        """The Python API's :class:`gradtrace.options.report.ReportOptions` of these options."""
        return api.ReportOptions(k=self.k, per_page=self.per_page, max_chars=self.max_chars, self_k=self.self_k)


OPTIONS = ReportCommand


def run(opts: ReportCommand) -> None:
    """Write the scores as one self-contained HTML page (works offline: no script, no external resource).

    Per query: its text, the top-k helpful and harmful training examples with score bars, and the score
    distribution over the training set; an index of all queries; optionally the highest self-influence.
    Positive score = the training example helps the query (lowers its loss).

    Example: gradtrace report ./scores --out report.html --self-influence
    """
    from ..report import build_report, recorded_sources, render_html, write_atomic
    from ..score import Scores

    started = time.perf_counter()
    if not opts.scores.exists():
        raise CliError(f"score directory {opts.scores} {why_missing(opts.scores)}")
    if not (opts.scores / "scores.json").exists():
        raise CliError(f"{opts.scores} holds no saved scores (no scores.json); write them with gradtrace score")
    out = opts.out if opts.out is not None else opts.scores / "report.html"
    if out.is_dir():
        raise CliError(f"--out {out} is a directory; give the report's file name (e.g. {out / 'report.html'})")
    check_output_file(out, "--out", overwrite=opts.overwrite, own=opts.scores)
    scores = Scores.load(opts.scores)
    train_source, query_source = recorded_sources(scores.meta)
    texts, text_from = opts.text_options.texts("train", train_source)
    queries, query_from = opts.text_options.texts("query", query_source)
    self_scores, self_method = _self_scores(scores, opts) if opts.self_influence else (None, None)
    report = build_report(scores, texts, queries, opts.report_options(), self_scores=self_scores,
                          self_method=self_method, text_source=text_from, query_source=query_from)
    write_atomic(out, render_html(report))
    console().print(f"Report of {len(scores.query_ids):,} queries x {len(scores.train_ids):,} training examples "
                    f"written to {out} ({human_bytes(out.stat().st_size)}, {time.perf_counter() - started:.1f} s)")


def _self_scores(scores: Any, opts: ReportCommand) -> tuple[Any, str]:
    """Self-influence of every training example, from the store(s) and curvature the scores record."""
    import gradtrace

    from ..fit.methods import get_method

    config = scores.meta.get("config") or {}
    method = opts.self_method or scores.method
    if method == "grad_cos":
        raise CliError("grad_cos self-influence is 1 for every training example (an example's cosine with "
                       "itself): pass --self-method grad_dot (or another method)")
    if not config.get("store"):
        raise CliError("--self-influence needs the training store, which these scores do not record (scored in "
                       "Python): compute Attributor(...).self_scores() and pass it to Scores.to_html(self_scores=...)")
    spec = get_method(method)
    stores = [config["store"], *(config.get("checkpoint_stores") or [])] if spec.multi_checkpoint else \
        [config["store"]]
    options: dict[str, Any] = {"weights": list(config.get("lr") or [])} if spec.multi_checkpoint else {}
    if "curvature" in spec.needs:
        if not config.get("curvature"):
            raise CliError(f"--self-method {method} needs a fitted curvature, which these scores do not record: "
                           "choose a method without curvature (e.g. --self-method grad_dot)")
        options.update(curvature=config["curvature"], damping=config.get("damping"),
                       damping_mode=config.get("damping_mode"))
    for store in stores:
        if not (Path(store) / "manifest.json").exists():
            raise CliError(f"--self-influence: the store recorded with the scores, {store}, does not exist")
    attributor = gradtrace.Attributor(method, train=stores if spec.multi_checkpoint else stores[0], **options)
    if attributor.train_ids != list(scores.train_ids):
        raise CliError(f"--self-influence: the store {stores[0]} no longer holds the scored training examples "
                       "(ids differ); rescore, or leave out --self-influence")
    return attributor.self_scores(), method
