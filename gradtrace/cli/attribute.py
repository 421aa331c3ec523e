"""``gradtrace attribute RUN_DIR DATA QUERIES --out DIR``: from a Trainer/TRL run to scores and a report, at once.

The steps are today's commands, run in order with the options this command resolves, each under its own folder
of ``--out`` (so each stays available, and re-running resumes):

1. ``collect DATA --checkpoints-of RUN_DIR [--last K] --out DIR/stores``: one store per saved checkpoint, resumed
   where stores are already there (added checkpoints are collected, finished ones kept);
2. ``score DIR/stores/<latest> QUERIES --store ... --method M --out DIR/scores``: the checkpoints' ensemble, the
   latest checkpoint first (the model explained, which answers ``--generate``), with the diagnostics of
   :mod:`gradtrace.score.diagnostics`;
3. ``report DIR/scores --out DIR/report.html``.

With ``--method metagrad`` the steps are ``metagrad RECORDED QUERIES --out DIR/scores`` (the run that
:func:`gradtrace.replay.hf.record_trainer` recorded, ``--recorded``; RUN_DIR itself when it is one), then the
report: the scores differentiate each query's loss through every step of the run, so no checkpoint is collected
and DATA is not read (the recorded run holds its training examples as the data collator gave them).

Why a checkpoint ensemble by default: a fine-tune trained to convergence memorises its training set, its training
examples' gradients vanish, and every single-model method then ranks the right examples no better than chance;
the run's earlier checkpoints still carry the signal. ``bench/converged_sft.py`` measures it (docs/workflows.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import typer

from ..common.paths import why_missing
from . import collect, metagrad, report, score
from .collect import attributed_first, run_checkpoints
from .commands import cli, make_command, progress_flag
from .console import console
from .errors import CliError
from .outputs import check_output_dir, check_output_file

__all__ = ["OPTIONS", "AttributeCommand", "run"]

WHY_ENSEMBLE = ("an ensemble of the run's checkpoints: a fine-tune trained past convergence ranks its training data "
                "no better than chance, while its earlier checkpoints keep the signal (bench/converged_sft.py: "
                "final model 0-4 of 8, ensemble of all checkpoints 8 of 8, on 3 seeds)")


@dataclass(kw_only=True)
class AttributeCommand:
    """Options of ``gradtrace attribute``."""

    run_dir: Path = field(metadata=cli(
        "The run's output directory: its checkpoint-N directories (Trainer/TRL save_steps), full models or LoRA "
        "adapters.", argument=True, metavar="RUN_DIR"))
    data: Path = field(metadata=cli("The training data the run was trained on (as gradtrace collect reads it).",
                                    argument=True, metavar="DATA"))
    queries: Path = field(metadata=cli("The queries to explain (as gradtrace score reads them).", argument=True,
                                       metavar="QUERIES"))
    out: Path = field(metadata=cli("Directory of the results: stores/, scores/, report.html.", "--out", "-o",
                                   metavar="DIR"))
    method: Literal["grad_cos", "grad_dot", "metagrad"] = field(default="grad_cos", metadata=cli(
        "Method of every member (the ensemble divides each member's scores by their mean absolute value); "
        "metagrad: metagradients through the recorded run instead (--recorded; see gradtrace metagrad)."))
    recorded: Path | None = field(default=None, metadata=cli(
        "With --method metagrad: the run gradtrace.replay.hf.record_trainer recorded (default: RUN_DIR when it "
        "is one).", metavar="RECORDED_DIR"))
    start_step: int = field(default=0, metadata=cli(
        "With --method metagrad: the first optimizer step the reverse pass differentiates (gradtrace metagrad "
        "--start-step; default 0, the whole run).", min=0))
    last: int = field(default=0, metadata=cli(
        "Checkpoints used: the run's last K (default 0: every checkpoint, which measured best -- early checkpoints "
        "carry what a converged final model lost; each costs one collection).", min=0))
    rank: int | None = field(default=None, metadata=cli("LoGra rank (default: gradtrace collect's).", min=1))
    max_length: int | None = field(default=None, metadata=cli(
        "Tokens per example (default: gradtrace collect's).", min=1))
    truncate: bool = field(default=False, metadata=cli("Cut longer examples to --max-length instead of refusing."))
    generate: bool = field(default=False, metadata=cli(
        "Score the latest checkpoint's own greedy answers to the query prompts (gradtrace score --generate)."))
    tokenizer: Path | None = field(default=None, metadata=cli(
        "Tokenizer directory, for checkpoints saved without one (default: each checkpoint's own)."))
    base_model: Path | None = field(default=None, metadata=cli(
        "Base model directory of LoRA checkpoints (default: the one adapter_config.json names).",
        metavar="BASE_DIR"))
    k: int = field(default=10, metadata=cli("Training examples per query kept and shown in the report.", min=1))
    overwrite: bool = field(default=False, metadata=cli(
        "Replace scores and a report already in --out (the stores are always resumed, never replaced)."))
    progress: bool = progress_flag()


OPTIONS = AttributeCommand


def _invoke(name: str, module: object, args: list[object]) -> None:
    """Run ``gradtrace NAME ARGS`` in this process (its checks, errors and output as on the command line)."""
    app = typer.Typer(add_completion=False)
    app.command(name)(make_command(name, module.OPTIONS, module.run))  # type: ignore[attr-defined]
    command = typer.main.get_command(app)
    console().print(f"\n$ gradtrace {name} {' '.join(str(a) for a in args)}", markup=False, highlight=False,
                    soft_wrap=True)
    code = command.main(args=[str(a) for a in args], prog_name=f"gradtrace {name}", standalone_mode=False)
    if code:  # the step printed its one Error: line
        raise typer.Exit(code)


def run(opts: AttributeCommand) -> None:
    """From a Trainer/TRL run to scores and an HTML report: collect a store per checkpoint, score the queries
    against their ensemble, write the report (each step is a gradtrace command, printed as it runs).

    Example: gradtrace attribute ./run train.jsonl questions.jsonl --out ./attribution --generate
    """
    if opts.method == "metagrad":
        _run_metagrad(opts)
        return
    if opts.recorded is not None:
        raise CliError("--recorded applies to --method metagrad (the checkpoint ensemble reads RUN_DIR's checkpoints)")
    if opts.start_step:
        raise CliError("--start-step applies to --method metagrad (it truncates the reverse pass through the recorded "
                       "run)")
    checkpoints = run_checkpoints(opts.run_dir, opts.last or None)  # refuses a run without checkpoint-N
    scores_dir, report_path, stores_dir = _outputs(opts)
    names = [c.name for c in checkpoints]
    console().print(f"gradtrace attribute: {len(checkpoints)} checkpoint{'s' * (len(checkpoints) > 1)} of "
                    f"{opts.run_dir} ({', '.join(names)}); method {opts.method}"
                    + (f", {WHY_ENSEMBLE}" if len(checkpoints) > 1 else
                       " (one checkpoint: no ensemble; the diagnostics say whether to trust it)"),
                    markup=False, highlight=False, soft_wrap=True)
    progress = [] if opts.progress else ["--no-progress"]
    data_flags = [*(["--max-length", opts.max_length] if opts.max_length else []),
                  *(["--truncate"] if opts.truncate else []),
                  *(["--tokenizer", opts.tokenizer] if opts.tokenizer else []),
                  *(["--base-model", opts.base_model] if opts.base_model else [])]
    existing = [stores_dir / n for n in names if (stores_dir / n / "manifest.json").exists()]
    _invoke("collect", collect, [opts.data, "--checkpoints-of", opts.run_dir, "--last", len(checkpoints),
                                 "--out", stores_dir, *(["--rank", opts.rank] if opts.rank else []), *data_flags,
                                 *(["--resume"] if existing else []), *progress])
    stores = [stores_dir / checkpoints[c].name for c in attributed_first(checkpoints)]
    further = [arg for s in stores[1:] for arg in ("--store", s)]
    _invoke("score", score, [stores[0], opts.queries, *further, "--method", opts.method, "--out", scores_dir,
                             "--topk", opts.k, *data_flags, *(["--generate"] if opts.generate else []),
                             *(["--overwrite"] if opts.overwrite else []), *progress])
    _invoke("report", report, [scores_dir, "--out", report_path, "--k", opts.k,
                               *(["--overwrite"] if opts.overwrite else [])])
    console().print(f"\nDone: stores in {stores_dir}, scores in {scores_dir}, report {report_path}", markup=False,
                    highlight=False, soft_wrap=True)


def _outputs(opts: AttributeCommand) -> tuple[Path, Path, Path]:
    """``--out``'s scores directory, report and stores directory, checked (no overwrite unless asked), and the
    queries file checked."""
    scores_dir, report_path, stores_dir = opts.out / "scores", opts.out / "report.html", opts.out / "stores"
    check_output_dir(scores_dir, "--out", stem="scores", what="scores", overwrite=opts.overwrite)
    check_output_file(report_path, "--out", overwrite=opts.overwrite)
    if not opts.queries.exists():
        raise CliError(f"queries file {opts.queries} {why_missing(opts.queries)}")
    return scores_dir, report_path, stores_dir


def _run_metagrad(opts: AttributeCommand) -> None:
    """``--method metagrad``: ``gradtrace metagrad`` on the recorded run, then the report."""
    recorded = opts.recorded
    if recorded is None and (opts.run_dir / "manifest.json").exists():
        recorded = opts.run_dir
    if recorded is None:
        raise CliError(f"--method metagrad differentiates through a recorded run, and {opts.run_dir} is not one: pass "
                       "--recorded DIR, the directory gradtrace.replay.hf.record_trainer(trainer, DIR) wrote during "
                       "trainer.train()")
    ensemble_only = [flag for flag, given in (("--last", opts.last), ("--rank", opts.rank),
                                              ("--generate", opts.generate), ("--base-model", opts.base_model))
                     if given]
    if ensemble_only:
        raise CliError(f"{', '.join(ensemble_only)} appl{'ies' if len(ensemble_only) == 1 else 'y'} to the checkpoint "
                       "ensemble, not to --method metagrad (it replays the recorded run itself)")
    scores_dir, report_path, _ = _outputs(opts)
    console().print(f"gradtrace attribute: metagradients through the recorded run {recorded}; {opts.data} is not "
                    "read (the recorded run holds its training examples as the data collator gave them)",
                    markup=False, highlight=False, soft_wrap=True)
    progress = [] if opts.progress else ["--no-progress"]
    _invoke("metagrad", metagrad, [recorded, opts.queries, "--out", scores_dir,
                                   *(["--max-length", opts.max_length] if opts.max_length else []),
                                   *(["--truncate"] if opts.truncate else []),
                                   *(["--tokenizer", opts.tokenizer] if opts.tokenizer else []),
                                   *(["--start-step", opts.start_step] if opts.start_step else []),
                                   *(["--overwrite"] if opts.overwrite else []), *progress])
    _invoke("report", report, [scores_dir, "--out", report_path, "--k", opts.k,
                               *(["--overwrite"] if opts.overwrite else [])])
    console().print(f"\nDone: scores in {scores_dir}, report {report_path}", markup=False, highlight=False,
                    soft_wrap=True)
