"""``gradtrace collect MODEL_DIR DATA --out STORE``: per-example gradients of a dataset into a gradient store;
with several ``--model``, one store per model under ``--out`` (checkpoints for an ensemble)."""

from __future__ import annotations

import json
import re
import shlex
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..common.model_dir import adapter_base
from ..common.provenance import record_paths
from ..options import RunOptions, StoreOptions
from .commands import Group, cli, progress_flag, resolved
from .config import META_KEY, provenance, write_resolved
from .console import Phases, console, human_bytes
from .errors import CliError
from .groups import DATA_HELP, DataOptions, LayerOptions, ModelOptions, ProjectionOptions
from .load_model import load_model, load_tokenizer, pad_id, resolve_device, resolve_max_length
from .outputs import check_writable, resolved_output
from .preference import DPOOptions, pair_loss, read_examples

__all__ = ["OPTIONS", "CollectCommand", "StoreGroup", "attributed_first", "check_layers", "latest_checkpoint",
           "projection_label", "run", "store_layers", "trainer_step"]


@dataclass(kw_only=True)
class StoreGroup(Group):
    """Where the gradient store is written (--out), and how: the Python API's
    :class:`gradtrace.options.StoreOptions`, its fields as options."""

    panel = "Store"
    out: Path = field(metadata=cli("Directory of the gradient store to write.", "--out", "-o", metavar="STORE"))
    settings: StoreOptions = field(default_factory=StoreOptions)


@dataclass(kw_only=True)
class CollectCommand:
    """Options of ``gradtrace collect``."""

    model: Path | None = field(default=None, metadata=cli(
        "Local Hugging Face model directory (config, weights and tokenizer), or a PEFT/LoRA adapter directory "
        "(loaded on its base: --base-model); or give the models with --model and DATA alone.", argument=True,
        metavar="MODEL_DIR"))
    data: Path | None = field(default=None, metadata=cli(DATA_HELP, argument=True, metavar="DATA"))
    models: list[Path] = field(default_factory=list, metadata=cli(
        "Model directory, one store each (repeat: checkpoints or models; MODEL_DIR, when given, is the first). With "
        "several, --out is the directory the stores go in, one per model named after its directory.", "--model",
        "-m", "--checkpoint", metavar="MODEL_DIR"))
    checkpoints_of: Path | None = field(default=None, metadata=cli(
        "A training run's output directory: its Trainer checkpoints (checkpoint-N directories, in step order) "
        "after the --model ones, one store each.", metavar="RUN_DIR"))
    last: int | None = field(default=None, metadata=cli(
        "With --checkpoints-of: only its last K checkpoints (default: all).", min=1, metavar="K"))
    store_options: StoreGroup
    data_options: DataOptions
    dpo_options: DPOOptions
    projection_options: ProjectionOptions
    layer_options: LayerOptions
    model_options: ModelOptions
    progress: bool = progress_flag("Show a progress bar and the time profile.")
    dry_run: bool = field(default=False, metadata=cli(
        "Print the plan (examples, tokens, dims and bytes per example, store size against free disk, time) and "
        "stop: nothing is written."))
    force: bool = field(default=False, metadata=cli("Collect even when the planned store exceeds the free disk."))

    def capture_options(self) -> Any:
        """The Python API's :class:`gradtrace.options.CaptureOptions` of these options: the projection, the layers
        captured and left out, and --partial."""
        return self.layer_options.apply(self.projection_options.capture_options())


OPTIONS = CollectCommand


@dataclass
class _Target:
    """One store to write: the model directory it is collected with, the store's path, the rows it already holds."""

    model: Path
    out: Path
    already: int = 0


def run(opts: CollectCommand) -> None:
    """Collect per-example gradients of a dataset into a gradient store (one per model).

    Each example's gradient is that of its own loss (causal LM, summed over the tokens in its loss: all of a
    text, the completion of a prompt-completion pair, the assistant turns of a conversation; see --loss-on);
    a preference pair's is that of its DPO loss (--loss dpo, with the run's --beta and --ref-model).
    Gradients are projected with LoGra at capture time unless --projection none.

    Example: gradtrace collect ./model train.jsonl --out ./store --rank 16

    Several checkpoints (one store each under --out, named after each model directory; for gradtrace score's
    ensembles): gradtrace collect --model run/checkpoint-500 --model run/checkpoint-1000 train.jsonl --out stores
    """
    import gradtrace

    phases = Phases()
    store_opts, data_opts, model_opts = opts.store_options, opts.data_options, opts.model_options
    models, data = _models_and_data(opts)
    targets = _targets(models, store_opts)
    with phases("load model"):
        tokenizer = load_tokenizer(model_opts.tokenizer or models[0], model_opts.base_model)
        device = resolve_device(model_opts.device)
        model = load_model(models[0], device, model_opts.model_dtype, model_opts.base_model)
    with phases("read data"):
        max_length = resolve_max_length(data_opts.max_length, model)
        batches = read_examples(data, tokenizer, data_opts, opts.dpo_options, max_length, pad_id(tokenizer), device,
                                model_opts.model_dtype)
    phases.note("read data", f"{batches.summary.total_tokens:,} tokens")
    console().print(batches.summary.line(), markup=False, highlight=False, soft_wrap=True)
    capture_options = opts.capture_options()
    projection, settings = capture_options.projection, store_opts.settings
    check_layers(model, capture_options)
    if targets[0].already:
        _check_resume(replace(store_opts, out=targets[0].out), projection, model)
    with phases("plan"):
        planned = gradtrace.plan(model, batches, pair_loss(batches, opts.dpo_options), store=store_opts.out,
                                 options=capture_options, store_options=settings, run=RunOptions(device=device))
    console().print(plan_lines(planned, store_opts.out, stores=len(targets)), markup=False, highlight=False,
                    soft_wrap=True)
    _check_shard_bytes(settings.shard_bytes, planned.dim, settings.store_dtype)
    if opts.dry_run:
        return
    total = planned.store_bytes * len(targets)
    if planned.free_bytes is not None and total > planned.free_bytes and not opts.force:
        raise CliError(f"the store{'s need' if len(targets) > 1 else ' needs'} about {human_bytes(total)} but "
                       f"{store_opts.out} has {human_bytes(planned.free_bytes)} free: free space, choose another "
                       "--out, store --dtype int8 or a smaller --rank, or pass --force")
    final = replace(opts, model=None, models=[], checkpoints_of=None, last=None, data=data,
                    data_options=replace(data_opts, max_length=max_length),
                    model_options=replace(model_opts, device=device))
    stores = []
    for c, target in enumerate(targets):
        if c > 0:
            with phases("load model"):
                model = load_model(target.model, device, model_opts.model_dtype, model_opts.base_model)
            if target.already:
                _check_resume(replace(store_opts, out=target.out), projection, model)
        stores.append(_collect_one(gradtrace, model, batches, target, final, phases, progress=opts.progress))
        del model
    listed = [stores[c] for c in attributed_first([t.model for t in targets])]  # an ensemble of the stores
    further = "".join(f" --store {shlex.quote(str(s))}" for s in listed[1:])
    console().print(f"Next: gradtrace score {shlex.quote(str(listed[0]))} QUERIES.jsonl{further} --out SCORES_DIR",
                    markup=False, highlight=False, soft_wrap=True)
    if listed != stores:
        console().print(f"  (the latest checkpoint first: {listed[0].name} is STORE, the model explained, and answers "
                        "with --generate)", markup=False, highlight=False, soft_wrap=True)
    if opts.progress:
        console(stderr=True).print(phases.table())


def _models_and_data(opts: CollectCommand) -> tuple[list[Path], Path]:
    """The model directories in order (MODEL_DIR, then each --model, then the --checkpoints-of ones) and the data:
    with --model or --checkpoints-of and one argument, that argument is DATA."""
    if opts.last is not None and opts.checkpoints_of is None:
        raise CliError("--last K takes the last K checkpoints of --checkpoints-of RUN_DIR: give the run directory")
    run = run_checkpoints(opts.checkpoints_of, opts.last) if opts.checkpoints_of is not None else []
    if opts.data is None and opts.model is not None and (opts.models or run):
        return [*opts.models, *run], opts.model
    if opts.data is None:
        raise CliError("give the model and the data: gradtrace collect MODEL_DIR DATA --out STORE, or gradtrace "
                       "collect --model MODEL_DIR [--model MODEL_DIR_2 ...] DATA --out DIR")
    assert opts.model is not None  # a second argument implies the first
    return [opts.model, *opts.models, *run], opts.data


def run_checkpoints(run: Path, last: int | None = None) -> list[Path]:
    """The Trainer checkpoints of the run output directory ``run`` (its ``checkpoint-N`` directories) in step
    order; with ``last``, the last ``last`` of them. Each is then checked as a model directory like a --model."""
    if not run.is_dir():
        raise CliError(f"--checkpoints-of {run} is not a directory")
    found = sorted((step, p) for p in run.iterdir() if p.is_dir() and (step := trainer_step(p)) is not None)
    if not found:
        raise CliError(f"--checkpoints-of {run} holds no Trainer checkpoint (checkpoint-N directories): give the "
                       "run's output_dir, or the checkpoints with --model")
    paths = [path for _, path in found]
    return paths[-last:] if last else paths


def trainer_step(path: Path) -> int | None:
    """The step ``N`` of a Trainer ``checkpoint-N`` directory (by its name), else None."""
    found = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(found.group(1)) if found else None


def latest_checkpoint(models: Sequence[Path]) -> int | None:
    """Which of ``models`` is the latest checkpoint of one training run: the highest step ``N`` when there are
    several and every one is a Trainer ``checkpoint-N`` directory of the same run directory; else None
    (independently trained models, checkpoints of several runs, or one model)."""
    steps = [trainer_step(m) for m in models]
    if len(models) < 2 or None in steps or len({m.resolve().parent for m in models}) > 1:
        return None
    return max(range(len(models)), key=lambda c: steps[c] or 0)


def attributed_first(models: Sequence[Path]) -> list[int]:
    """The order the printed ``gradtrace score`` command lists the stores of ``models`` in: the checkpoints of one
    Trainer run latest first -- STORE is then the final model, the one explained, which answers ``--generate`` --
    and other models as given (STORE: the first)."""
    if latest_checkpoint(models) is None:
        return list(range(len(models)))
    return sorted(range(len(models)), key=lambda c: -(trainer_step(models[c]) or 0))


def _targets(models: list[Path], store_opts: StoreGroup) -> list[_Target]:
    """The stores to write, checked before any model work: --out itself for one model; for several, one per model
    under --out, named after its directory (two directories of one name are refused)."""
    from ..capture.checkpoints import checkpoint_names
    from ..common.model_dir import check_model_dir

    if len(models) == 1:
        return [_Target(models[0], store_opts.out, _check_target(store_opts))]
    for path in models:
        check_model_dir(path)
    if (store_opts.out / "manifest.json").exists():
        raise CliError(f"--out {store_opts.out} is a gradient store; with several --model, --out is the directory "
                       "their stores go in: choose another one")
    names = checkpoint_names(models, what="gradtrace collect", fix="give model directories of distinct names, or "
                             "collect the clashing ones into separate --out directories")
    return [_Target(m, store_opts.out / n, _check_target(replace(store_opts, out=store_opts.out / n)))
            for m, n in zip(models, names)]


def _collect_one(gradtrace: Any, model: Any, batches: Any, target: _Target, final: CollectCommand, phases: Phases,
                 *, progress: bool) -> Path:
    """Collect one store (``final``: the resolved options, completed with this store's model and path) and print
    what it holds; its resolved configuration is written beside it (with the base model of a PEFT adapter, which
    ``gradtrace score`` then loads it on)."""
    settings = final.store_options.settings
    out, capture_options = target.out, final.capture_options()
    base = adapter_base(target.model, final.model_options.base_model)
    values = resolved(replace(final, model=target.model, store_options=replace(final.store_options, out=out),
                              model_options=replace(final.model_options, base_model=base)))
    for key in ("models", "checkpoints_of", "last"):  # each store records its own model (MODEL_DIR)
        values.pop(key)
    with phases("gradients"), _interrupt_reported(out), _coverage_reported(out):
        config = record_paths({META_KEY: provenance("collect", final.data, batches.num_examples), **values}, out)
        store = gradtrace.collect(model, batches, pair_loss(batches, final.dpo_options), store=out,
                                  options=capture_options, store_options=replace(settings, config=config),
                                  run=RunOptions(device=final.model_options.device, progress=progress))
    seconds = phases.seconds["gradients"]
    phases.note("gradients", f"{batches.num_examples / max(seconds, 1e-9):,.1f} examples/s")
    _print_stored(store, out, target.already, settings.resume, write_resolved(out, "collect", values),
                  batches.no_target_ids())
    return out


def _print_stored(store: Any, out: Path, already: int, resume: bool, written: Path, single: list[str]) -> None:
    """What a collected store holds: new rows, size, projection, its configuration, and what was not stored."""
    info = store.info()
    printer = console()
    new = len(store) - already
    resumed = f" ({already:,} were already stored)" if resume and already else ""
    printer.print(f"Stored {new:,} new example{'' if new == 1 else 's'}{resumed} in {out}")
    printer.print(f"  rows x dim  {len(store):,} x {info['dim']:,} ({info['dtype']}, {human_bytes(info['bytes'])})")
    printer.print(f"  projection  {projection_label(info['projection'])}")
    printer.print(f"  config      {written}")
    from ..capture.coverage import recorded_coverage

    coverage = recorded_coverage(store.manifest)
    if coverage is not None:
        printer.print(f"  coverage    {coverage.line()}", markup=False, highlight=False, soft_wrap=True)
    nonfinite = [i for r in store.ranks.values() for i in (r.get("skipped") or {}).get("nonfinite", [])]
    if nonfinite:
        printer.print(f"[yellow]Warning: {len(nonfinite)} examples had NaN/inf gradients and were not stored "
                      f"(first ids: {json.dumps(nonfinite[:3])}).[/yellow]")
    if single:
        printer.print(f"[yellow]Warning: {len(single)} example{' has' if len(single) == 1 else 's have'} no token in "
                      "the loss (a single token, or nothing after the prompt), so nothing to predict: stored with a "
                      f"zero gradient (first ids: {json.dumps(single[:3])}).[/yellow]")


@contextmanager
def _coverage_reported(out: Path) -> Iterator[None]:
    """A trainable parameter found uncapturable while capturing (a call whose rows cannot be matched to examples)
    stops the run with one line naming the --exclude / --partial that go on. The layers no rule can capture were
    refused before, on the model (:func:`check_layers`)."""
    from ..capture.coverage import CoverageError, uncovered_message

    try:
        yield
    except CoverageError as err:
        raise CliError(f"{uncovered_message(err.coverage, err.when, cli=True)}; {out} is incomplete: collect again "
                       "with --overwrite") from None


@contextmanager
def _interrupt_reported(out: Path) -> Iterator[None]:
    """Ctrl-C or SIGTERM during the capture: one line saying what is committed and how to go on; exit code
    128 + the signal's number (130, 143), as a shell reports a process stopped by it."""
    try:
        yield
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        from ..store import GradientStore, StoreError

        try:
            rows = f"{len(GradientStore.open(out, verify=False, allow_incomplete=True)):,} rows are"
        except (StoreError, ValueError, OSError):
            rows = "nothing is"
        raise CliError(f"interrupted by {signal.Signals(signum).name}: {rows} committed in {out} (marked interrupted); "
                       "run the same command with --resume to finish it", exit_code=128 + signum) from None


def store_layers(store: Any) -> list[str] | None:
    """The modules whose parameters ``store`` holds, when it was collected with ``--layers`` / ``--exclude`` (its
    recorded capture options name patterns) or ``--partial`` (its recorded coverage leaves parameters out): what other
    gradients compared with it (the queries of gradtrace score, a re-capture) must capture. None for a store of every
    supported module, which the default selection gives."""
    from ..capture.coverage import recorded_coverage

    config = store.manifest.get("config") or {}
    recorded = (((config.get("gradtrace") or {}).get("options") or {}).get("capture")) or {}
    coverage = recorded_coverage(store.manifest)
    if not (recorded.get("layers") or recorded.get("exclude") or recorded.get("partial")
            or (coverage is not None and coverage.left_out)):
        return None
    from ..fit.curvature.fit import modules_of

    return modules_of([name for name, _ in store.spec.params])


def check_layers(model: Any, options: Any) -> None:
    """``--layers`` / ``--exclude`` / ``--partial`` checked on the loaded model, before the plan's warm-up: a pattern
    that matches no module, or a left-out module that shares a parameter with a captured one, is refused on one line
    (as ``gradtrace.collect`` would refuse it); without ``--partial``, so is a trainable parameter that no layer rule
    can capture per example, naming the ``--exclude`` that leaves it out on purpose."""
    from ..capture.coverage import CaptureReport, coverage_of, uncovered_message
    from ..capture.layer_selection import select_layers

    try:
        selection = select_layers(model, options.layers, options.exclude, options.include_frozen)
    except ValueError as err:
        message = str(err)
        for name in ("layers", "exclude"):  # the API names its arguments: name the flags
            if message.startswith((f"{name}:", f"{name}=")):
                message = f"--{name}{message[len(name):]}"
                break
        else:
            given = [flag for flag, value in (("--layers", options.layers), ("--exclude", options.exclude)) if value]
            message = f"{' / '.join(given)}: {message}" if given else message
        if "is excluded but shares parameter" in message:
            message += ": leave out every module that holds the tied weight, or none of them"
        raise CliError(message) from None
    coverage = coverage_of(model, selection, CaptureReport.from_selection(selection), options.partial)
    if coverage.uncovered and not options.partial:
        raise CliError(uncovered_message(coverage, cli=True))


def _check_shard_bytes(shard_bytes: int | None, dim: int, dtype: str) -> None:
    """Refuse, before any gradient, ``--shard-bytes`` smaller than one stored row (naming the row's size)."""
    from ..store.shards import row_bytes

    one = row_bytes(dim, dtype)
    if shard_bytes is not None and shard_bytes < one:
        raise CliError(f"--shard-bytes {shard_bytes:,} is smaller than one row of this store ({one:,} bytes: {dim:,} "
                       f"values in {dtype}); pass --shard-bytes {one:,} or more (default: 256 MiB)")


def plan_lines(planned: Any, out: Path, stores: int = 1) -> str:
    """The printed plan: what will be collected and what it takes (``stores``: one per model, each the same size
    and time, from the first model's warm-up)."""
    tokens = "" if planned.tokens is None else f", {planned.tokens:,} tokens"
    free = "" if planned.free_bytes is None else f" ({human_bytes(planned.free_bytes)} free there)"
    each = "" if stores == 1 else f" ({stores} stores x {human_bytes(planned.store_bytes)})"
    times = "" if stores == 1 else f" ({stores} models x {planned.seconds:,.0f} s)"
    return "\n".join([
        f"Plan: {planned.examples:,} examples{tokens}; {planned.params:,} captured parameters",
        f"  per example {planned.dim:,} dims, {human_bytes(planned.bytes_per_example)} ({planned.dtype})",
        f"  store{'s' if stores > 1 else ' '}      about {human_bytes(stores * planned.store_bytes)}{each} in "
        f"{out}{free}", *_memory_line(planned.memory),
        f"  time        about {stores * planned.seconds:,.0f} s{times} ({planned.seconds_per_example * 1e3:,.1f} "
        "ms/example, from a warm-up)"])


def _memory_line(memory: Any) -> list[str]:
    """The plan's memory line (none without an estimate): the peak of one capture step, beside the weights
    (:func:`gradtrace.capture.memory.estimate_step_memory`)."""
    if memory is None:
        return []
    return [f"  memory      about {human_bytes(memory.total)} per step at batch {memory.batch} x {memory.length} "
            f"tokens: activations {human_bytes(memory.activations)}, logits {human_bytes(memory.logits)}, backward "
            f"{human_bytes(memory.backward)}, rows {human_bytes(memory.rows)} (model weights "
            f"{human_bytes(memory.weights)} besides)"]


def _check_target(store_opts: StoreGroup) -> int:
    """Refuse, before any data or model work, a store another run is writing, and an existing store without
    --resume/--overwrite; returns the rows it already holds."""
    out, settings = store_opts.out, store_opts.settings
    if settings.shard_rows is not None and settings.shard_bytes is not None:
        raise CliError("--shard-rows and --shard-bytes both size the shards; pass one of them")
    resolved_output(out, "--out")  # a symbolic link loop, an over-long name: refused here
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    check_writable(out, "--out")
    _check_not_locked(out)
    if not (out / "manifest.json").exists():
        return 0
    if not (settings.resume or settings.overwrite):
        raise CliError(f"{out} already holds a gradient store: pass --resume to add the examples it lacks, or "
                       "--overwrite to replace it")
    if settings.overwrite:
        return 0
    from ..store import GradientStore

    return len(GradientStore.open(out, verify=False, allow_incomplete=True))


def _check_not_locked(out: Path) -> None:
    """Refuse a store whose write lock a live run holds (a lock left by a dead process is taken over later)."""
    from ..store.layout import lock_is_stale, read_lock

    if not out.is_dir():
        return
    for lock in sorted(out.glob("rank-*.lock")):
        try:
            rank = int(lock.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        holder = read_lock(out, rank)
        if holder is not None and not lock_is_stale(holder):
            raise CliError(f"{out} is being written by another run (pid {holder.get('pid')} on {holder.get('host')}, "
                           f"{lock.name}); two runs cannot write one store. Wait for it to finish, or delete {lock} "
                           "if that run is gone")


def _check_resume(store_opts: StoreGroup, projection: Any, model: Any) -> None:
    """``--resume`` must use the store's model weights, projection, loss convention and dtype: another is refused
    before the plan's warm-up or any gradient (checked even when every example is already stored)."""
    from ..store import GradientStore
    from ..store.spec import model_fingerprint, resume_mismatch
    from ..store.writer import resolved_store_options

    spec = GradientStore.open(store_opts.out, verify=False, allow_incomplete=True).spec
    wanted = projection.to_dict() if projection is not None else None
    why = resume_mismatch(spec, model=model_fingerprint(model), projection=wanted, example_loss="sum",
                          dtype=resolved_store_options(store_opts.out, store_opts.settings).dtype,
                          describe=projection_label)
    if why is not None:
        raise CliError(f"cannot --resume {store_opts.out}: {why}; resume with the model and settings that started it, "
                       "or pass --overwrite to replace the store")


def projection_label(spec: dict | None) -> str:
    """``LoGra rank 16x16 (vectors 16), seed 0`` / ``none (exact gradients)``."""
    if not spec:
        return "none (exact gradients)"
    if spec.get("kind") == "logra":
        overrides = "".join(f", {glob} {rows}x{cols}" for glob, rows, cols in spec.get("ranks", ()))
        return (f"LoGra rank {spec.get('rank_rows')}x{spec.get('rank_cols')} (vectors {spec.get('vector_rank')}"
                f"{overrides}), seed {spec.get('seed')}")
    return json.dumps(spec)
