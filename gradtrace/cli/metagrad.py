"""``gradtrace metagrad RUN_DIR QUERIES --out SCORES_DIR``: metagradient scores through a recorded training run.

The run is one :func:`gradtrace.replay.hf.record_trainer` recorded (its directory holds the model's configuration,
the tokenizer and the training examples as the collator gave them), so nothing of the user's code is needed: the
model is built from the saved configuration with eager attention (the CPU SDPA kernel has no double backward), the
batches come from :func:`gradtrace.replay.examples.load_examples`, the training loss is
:func:`gradtrace.replay.hf.run_loss` (``causal_lm_loss``, the labels counted as the Trainer counted them). Each
query's loss is its summed token loss (the library's per-example convention, as ``gradtrace score`` takes it). The
scores are ``-dL_q/dw_i`` (positive: up-weighting the training
example lowers the query's loss, it helps), saved as :class:`gradtrace.Scores` with method ``metagradients``; the
decoded text of every training example goes beside them (``train_texts.jsonl``) for ``gradtrace topk`` and
``gradtrace report``.

Before any replay a plan is printed: steps, parameters, checkpoint spacing, memory, disk and a time estimate from
one timed replay step and one timed reverse step of a block of queries (its peak memory too, on a CUDA device);
``--dry-run`` stops there.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..common.paths import why_missing
from ..common.units import human_bytes
from ..options import MetagradOptions
from .commands import Group, api_field, cli, progress_flag, resolved
from .config import META_KEY, provenance, write_resolved
from .console import Phases, console
from .errors import CliError
from .groups import DataOptions
from .outputs import check_output_dir

__all__ = ["OPTIONS", "MetagradCommand", "run"]

AMPLIFIED = 1000
"""The growth of the reverse pass's cotangent (norm against its value at the end of the run) past which the command
points to truncated passes."""

TEXTS_FILE = "train_texts.jsonl"
TEXT_CHARS = 2000
"""Characters of each training example's decoded text kept beside the scores (topk and report cut them further)."""


@dataclass(kw_only=True)
class ReplayFlags(Group):
    """How the run is replayed and differentiated (:class:`gradtrace.options.MetagradOptions`)."""

    panel = "Metagradients"
    start_step: int = field(default=0, metadata=api_field(MetagradOptions, "start_step"))
    checkpoint_every: int | None = field(default=None, metadata=api_field(MetagradOptions, "checkpoint_every"))
    query_batch: int | None = field(default=None, metadata=api_field(MetagradOptions, "query_batch"))
    memory_limit: int = field(default=2 << 30, metadata=api_field(MetagradOptions, "memory_limit"))
    tolerance: float | None = field(default=None, metadata=api_field(MetagradOptions, "tolerance"))
    dtype: Literal["float32", "float64"] = field(default="float32", metadata=cli(
        "Precision of the replay and the scores (float64: a float32 run replayed in float64, checked against its "
        "float32 final weights with the float32 bound)."))

    def options(self, tolerance: float | None) -> Any:
        """The Python API's :class:`gradtrace.options.MetagradOptions` of these flags (``tolerance`` resolved)."""
        return MetagradOptions(start_step=self.start_step, checkpoint_every=self.checkpoint_every,
                               query_batch=self.query_batch, memory_limit=self.memory_limit, tolerance=tolerance)


@dataclass(kw_only=True)
class MetagradCommand:
    """Options of ``gradtrace metagrad``."""

    run_dir: Path = field(metadata=cli("Recorded training run (gradtrace.replay.hf.record_trainer's directory).",
                                       argument=True, metavar="RUN_DIR"))
    queries: Path = field(metadata=cli("Query examples, read like gradtrace score's: .jsonl, .json, .parquet, .csv, "
                                       ".txt or a save_to_disk directory.", argument=True, metavar="QUERIES"))
    out: Path = field(metadata=cli("Directory to save the scores in (read it with gradtrace topk).", "--out", "-o",
                                   metavar="SCORES_DIR"))
    overwrite: bool = field(default=False, metadata=cli("Replace scores already saved in --out."))
    tokenizer: Path | None = field(default=None, metadata=cli(
        "Tokenizer directory for the queries (default: the one saved with the run, in RUN_DIR/model).",
        metavar="TOKENIZER_DIR"))
    device: str = field(default="auto", metadata=cli(
        "Device of the replay: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."))
    replay_flags: ReplayFlags
    data_options: DataOptions
    progress: bool = progress_flag("Show the time profile at the end.")
    dry_run: bool = field(default=False, metadata=cli(
        "Print the plan (steps, parameters, checkpoints, memory, disk, time from one timed replay step) and stop: "
        "nothing is replayed, nothing is written."))


OPTIONS = MetagradCommand


@dataclass
class Setup:
    """What the replay runs on, every input checked (:func:`_load`)."""

    run: Any  # the RecordedRun, its tensors in ``dtype``
    model: Any
    loss_fn: Any  # run_loss(RUN_DIR): the Trainer's training loss
    batches: Any  # batches(ids), on ``device``
    examples: Any  # the RecordedExamples (their rows for the texts)
    queries: list[dict[str, Any]]  # one batch per query
    query_ids: list[str]
    tokenizer: Any
    tokenizer_path: Path
    dtype: Any
    options: Any  # MetagradOptions
    device: str

    def query_loss(self, forward: Any, query: dict[str, Any]) -> Any:
        """A query's loss: its summed token loss (the library's per-example convention)."""
        return self.loss_fn(forward, query)[0].sum()


def run(opts: MetagradCommand) -> None:
    """Score training examples by differentiating each query's loss through a recorded training run.

    The run is a directory gradtrace.replay.hf.record_trainer wrote; the scores are saved like gradtrace score's, so
    gradtrace topk and gradtrace report show them. Positive score = the training example helps the query
    (up-weighting it in the same run lowers the query's loss).

    Example: gradtrace metagrad runs/r1 queries.jsonl --out scores
    """
    phases = Phases()
    with phases("load"):
        setup = _load(opts)
    with phases("plan"):
        _print_plan(setup, opts)
    if opts.dry_run:
        console().print("Dry run: nothing replayed, nothing written.")
        return
    from ..replay import metagradients

    with phases("metagradients"):
        result = metagradients(setup.run, setup.model, setup.loss_fn, setup.batches, setup.queries,
                               setup.query_loss, options=setup.options)
    with phases("save"):
        _save(opts, setup, result)
    out = console()
    difference = result.replay_difference
    out.print(f"Saved metagradient scores of {len(setup.query_ids):,} queries against {len(result.ids):,} training "
              f"examples to {opts.out} (replay difference {difference:.2e}, relative)." if difference is not None
              else f"Saved metagradient scores to {opts.out}.", markup=False, highlight=False)
    if result.growth:
        out.print(_growth_line(result.growth), markup=False, highlight=False)
    out.print(f"Show them: gradtrace topk {opts.out}", markup=False, highlight=False)
    if opts.progress:
        out.print(phases.table())


def _load(opts: MetagradCommand) -> Setup:
    """The run (in ``--dtype``), model, batches, losses and queries; every input checked before any replay."""
    import torch

    from ..common.model_dir import TOKENIZER_FILES
    from ..replay import load_run
    from ..replay.examples import has_examples, load_examples
    from ..replay.hf import run_loss
    from ..replay.replay import DEFAULT_TOLERANCE
    from .load_model import resolve_device

    run_dir = opts.run_dir
    if not run_dir.exists():
        raise CliError(f"run directory {run_dir} {why_missing(run_dir)}")
    if not (run_dir / "manifest.json").exists():
        raise CliError(f"{run_dir} is not a recorded run (no manifest.json): record one with "
                       "gradtrace.replay.hf.record_trainer(trainer, RUN_DIR) and let trainer.train() finish")
    if not (run_dir / "model" / "config.json").exists() or not has_examples(run_dir):
        raise CliError(f"{run_dir} holds a run without its saved model configuration and examples (model/config.json, "
                       "examples.json): record it with gradtrace.replay.hf.record_trainer(..., examples=True), or use "
                       "the Python API (gradtrace.replay.metagradients) with your own model and batches")
    if not opts.dry_run:
        check_output_dir(opts.out, "--out", stem="scores", what="scores", overwrite=opts.overwrite)
    device = resolve_device(opts.device)
    dtype = getattr(torch, opts.replay_flags.dtype)
    run = load_run(run_dir)
    recorded = {getattr(torch, info["dtype"]) for info in run.manifest["params"].values()}
    tolerance = opts.replay_flags.tolerance
    if tolerance is None:  # the bound of the coarsest precision involved
        tolerance = max(DEFAULT_TOLERANCE.get(d, 1e-4) for d in recorded | {dtype})
    run.cast(dtype)
    model = _model(run_dir / "model", dtype, device)
    tokenizer_path = opts.tokenizer or run_dir / "model"
    if opts.tokenizer is None and not any((tokenizer_path / name).is_file() for name in TOKENIZER_FILES):
        raise CliError(f"{run_dir} holds no tokenizer (the Trainer had no processing_class): pass --tokenizer DIR")
    tokenizer = _tokenizer(tokenizer_path)
    examples = load_examples(run_dir)
    batches = examples if device == "cpu" else (lambda ids: {k: v.to(device) for k, v in examples(ids).items()})
    loss_fn = run_loss(run_dir, dtype=torch.float32 if dtype == torch.float32 else None)
    queries, query_ids = _queries(opts, tokenizer, model, device)
    return Setup(run, model, loss_fn, batches, examples, queries, query_ids, tokenizer, tokenizer_path, dtype,
                 opts.replay_flags.options(tolerance), device)


def _tokenizer(path: Path) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, local files only (a tokenizer directory needs no config.json)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise CliError(f"no tokenizer could be read from {path}: {err}") from None


def _model(config_dir: Path, dtype: Any, device: str) -> Any:
    """The saved architecture, randomly initialised (the replay runs it on the recorded weights), eager attention."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    config._attn_implementation = "eager"  # the CPU SDPA kernel has no double backward
    name = (config.architectures or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager")
    return model.to(dtype=dtype, device=device).train()


def _queries(opts: MetagradCommand, tokenizer: Any, model: Any, device: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One batch per query (``input_ids``, ``attention_mask``, ``labels``: -100 outside its loss), and their ids."""
    import numpy as np

    from .load_data import read_dataset
    from .load_model import pad_id, resolve_max_length

    data = read_dataset(opts.queries, tokenizer, opts.data_options, resolve_max_length(opts.data_options.max_length,
                                                                                       model),
                        pad_id(tokenizer), what="queries")
    if not data.num_examples:
        raise CliError(f"queries {opts.queries} hold no examples")
    empty = data.no_target_ids()
    if empty:
        raise CliError(f"{len(empty)} quer{'y' if len(empty) == 1 else 'ies'} of {opts.queries} have no loss tokens "
                       f"(ids {empty[:5]}): give each query a target (a completion, or a text of 2+ tokens)")
    queries = []
    for index in range(data.num_examples):
        batch = {k: v for k, v in data.rows(np.array([index])).items() if k in ("input_ids", "attention_mask",
                                                                               "labels")}
        batch.setdefault("labels", batch["input_ids"].clone())
        queries.append({k: v.to(device) for k, v in batch.items()})
    return queries, [str(i) for i in data.ids]


@dataclass
class Timing:
    """What the plan measured: one replay step (forward, backward, update) and one reverse step of a block of
    queries, in seconds; the reverse step's peak memory above what was allocated before it (CUDA only, else None)."""

    step: float
    reverse: float
    reverse_peak: int | None = None


def plan_lines(setup: Setup, timing: Timing, state_bytes: int) -> list[str]:
    """The plan, one line each: steps, parameters, checkpoint spacing, memory, disk and time."""
    from ..replay.checkpoints import default_interval

    run, options = setup.run, setup.options
    from ..replay.states import nearest_state

    total, first = len(run.steps), options.start_step
    reversed_steps = total - first
    begin = nearest_state(run.states, first)
    forward = total - begin
    every = options.checkpoint_every or default_interval(reversed_steps)
    params = sum(run.initial[name].numel() for name in run.optimizer.param_names())
    count = len(setup.queries)
    block = min(options.query_batch or count, count)
    blocks = math.ceil(count / block)
    checkpoints = math.ceil(reversed_steps / every)
    in_memory = min(checkpoints, options.memory_limit // max(state_bytes, 1))
    memory = (in_memory + every + block) * state_bytes
    disk = (checkpoints - in_memory) * state_bytes
    seconds = forward * timing.step + reversed_steps * blocks * (timing.step + timing.reverse)
    dtype = str(setup.dtype).removeprefix("torch.")
    graph = (f"plus one reverse step's graph, measured: {human_bytes(timing.reverse_peak)} (peak above the states "
             f"then), so about {human_bytes(memory + timing.reverse_peak)} in all" if timing.reverse_peak is not None
             else "plus one reverse step's graph (measured on CUDA devices only)")
    return [
        f"Run {run.run_dir}: {total:,} optimizer steps ({run.optimizer.kind}, accumulation {run.accumulation}), "
        f"{len(run.example_ids()):,} training examples, {params:,} parameters in {dtype}.",
        f"Queries: {count:,} in {blocks:,} reverse pass(es) of up to {block:,}"
        + (f", each over steps {first:,}..{total - 1:,} ({reversed_steps:,} of {total:,}: --start-step {first:,} "
           "truncates the pass; the weights of earlier steps are not differentiated)." if first else
           ", each over the whole run."),
        f"Checkpoints every k = {every:,} steps: {checkpoints:,} checkpoints + {every:,} states of one segment; one "
        f"state (weights and optimizer buffers) is {human_bytes(state_bytes)}.",
        f"Memory: ({in_memory:,} checkpoints in memory + k = {every:,} segment states + {block:,} query cotangents) x "
        f"{human_bytes(state_bytes)} = {human_bytes(memory)}, {graph}.",
        f"Disk: {checkpoints - in_memory:,} checkpoints beyond --memory-limit {human_bytes(options.memory_limit)}: "
        f"{human_bytes(disk)} under {run.run_dir} (removed at the end).",
        (f"Forward replay from the state the run recorded before step {begin:,} (keep_states): {forward:,} of "
         f"{total:,} steps." if begin else "Forward replay from the initial weights: every step."),
        f"Time: {'(T - S)' if begin else 'T'} x t_step for the forward replay + {'(T - K)' if first else 'T'} x "
        f"{blocks:,} pass(es) x (t_step to recompute + t_reverse) = {forward:,} x {timing.step:.3g} + "
        f"{reversed_steps:,} x {blocks:,} x "
        f"({timing.step:.3g} + {timing.reverse:.3g}) s = about {_duration(seconds)} (t_step: one timed replay step, "
        f"forward + backward + update; t_reverse: one timed reverse step of {block:,} "
        f"quer{'y' if block == 1 else 'ies'}, {timing.reverse / timing.step:.1f} "
        "t_step).",
    ]


def _print_plan(setup: Setup, opts: MetagradCommand) -> None:
    """Time one replay step (the second, after a warm-up) and one reverse step of a block of queries (random
    cotangents: its cost does not depend on their values), and print :func:`plan_lines`."""
    import torch

    from ..replay.checkpoints import state_bytes
    from ..replay.metagrad import reverse_step
    from ..replay.step import StepFunction

    if not setup.run.steps:
        raise CliError(f"{opts.run_dir} records no optimizer step: nothing to differentiate")
    if setup.options.start_step >= len(setup.run.steps):
        raise CliError(f"--start-step {setup.options.start_step}: {opts.run_dir} records {len(setup.run.steps):,} "
                       f"optimizer step(s), so the reverse pass would differentiate none (expected 0..."
                       f"{len(setup.run.steps) - 1:,})")
    cuda = setup.device != "cpu"

    def timed(fn: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    steps = StepFunction(setup.run, setup.model, setup.loss_fn, setup.batches)
    first = steps.step(0, steps.initial_state())  # the first call also warms up: the second one is timed
    index = min(1, len(setup.run.steps) - 1)
    state = first if index else steps.initial_state()
    _, seconds = timed(lambda: steps.step(index, state))
    count = len(setup.queries)
    block = min(setup.options.query_batch or count, count)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    cotangent = {("param", name): torch.randn((block, *p.shape), generator=gen, dtype=p.dtype, device=p.device)
                 for name, p in state.params.items()}
    before = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    _, reverse = timed(lambda: reverse_step(steps, index, state, cotangent, block > 1))
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    out = console()
    out.print("Plan:", markup=False, highlight=False)
    for line in plan_lines(setup, Timing(seconds, reverse, peak), state_bytes(state)):
        out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


def _growth_line(growth: list[tuple[int, float]]) -> str:
    """How the reverse pass grew (``MetaGradients.growth``): the cotangent's norm at the run's end and start."""
    from ..replay.growth import growth_rate

    fitted = growth_rate(growth)
    if fitted is None:
        return f"Reverse pass: the parameters' cotangent had norm {growth[0][1]:.3g} at step {growth[0][0]}."
    first_step, first, last_step, last, rate = fitted
    line = (f"Reverse pass: the parameters' cotangent norm went from {first:.3g} at step {first_step} (the end of the "
            f"run) to {last:.3g} at step {last_step}, x{rate:.4g} per step on average (the largest over the queries).")
    crossed = next((step for step, norm in growth if norm > AMPLIFIED * first), None)
    if crossed is None:
        return line
    return line + (f" It passed {AMPLIFIED:,}x its value at the end by step {crossed}: a run that amplifies its "
                   "early steps this much is often not metasmooth there, and their derivatives then predict little. "
                   "Check it (gradtrace.replay.metasmoothness); a truncated pass over the later steps "
                   f"(--start-step {crossed} or later) may predict better (docs/metagradients.md, Truncated passes).")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def _save(opts: MetagradCommand, setup: Setup, result: Any) -> None:
    """``Scores`` (method ``metagradients``) in ``--out``, the resolved configuration and the training texts."""
    from ..score import Scores

    values = resolved(opts)
    values["tokenizer"] = str(Path(setup.tokenizer_path).absolute())  # the queries' content-hash ids need it
    config = {META_KEY: provenance("metagrad", opts.queries, len(setup.query_ids)), **values,
              "train_texts": str((opts.out / TEXTS_FILE).absolute())}
    run = setup.run
    meta = {"config": config, "metagradients": {
        "run_dir": str(run.run_dir.absolute()), "steps": len(run.steps), "dtype": opts.replay_flags.dtype,
        "replay_difference": result.replay_difference, "checkpoint_every": result.checkpoint_every,
        "growth": [list(pair) for pair in result.growth],
        "options": {k: v for k, v in asdict(setup.options).items() if k not in ("scales", "seed")},
        "query_loss": "summed token loss", "query_losses": result.query_losses.tolist(),
        "score": "-dL_q/dw_i: the derivative of the query's final loss in each training example's weight"}}
    scores = Scores(train_ids=[str(i) for i in result.ids], query_ids=setup.query_ids, method="metagradients",
                    matrix=result.scores.detach().cpu(), meta=meta)
    scores.save(opts.out, overwrite=opts.overwrite)
    write_resolved(opts.out, "metagrad", values)
    _write_texts(opts.out / TEXTS_FILE, setup, result.ids)


def _write_texts(path: Path, setup: Setup, ids: list[Any]) -> None:
    """``{"id", "text"}`` per training example: its saved ``input_ids`` decoded, cut to :data:`TEXT_CHARS`."""
    tokenizer, examples = setup.tokenizer, setup.examples
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for ident in ids:
            text = tokenizer.decode(examples.row(ident, "input_ids").tolist(), skip_special_tokens=True)
            handle.write(json.dumps({"id": str(ident), "text": text[:TEXT_CHARS]}) + "\n")
    os.replace(tmp, path)
