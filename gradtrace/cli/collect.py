"""``gradtrace collect MODEL_DIR DATA --out STORE``: per-example gradients of a dataset into a gradient store."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..options import StoreOptions
from ..provenance import record_paths
from .config import META_KEY, provenance, write_resolved
from .dataset import read_dataset
from .errors import CliError
from .groups import DATA_HELP, DataOptions, ModelOptions, ProjectionOptions
from .models import load_model, load_tokenizer, pad_id, resolve_device, resolve_max_length
from .options import Group, cli, progress_flag, resolved
from .report import Phases, console, human_bytes

__all__ = ["OPTIONS", "CollectOptions", "StoreGroup", "projection_label", "run"]


@dataclass(kw_only=True)
class StoreGroup(Group):
    """Where the gradient store is written (--out), and how: the Python API's
    :class:`gradtrace.options.StoreOptions`, its fields as options."""

    panel = "Store"
    out: Path = field(metadata=cli("Directory of the gradient store to write.", "--out", "-o", metavar="STORE"))
    settings: StoreOptions = field(default_factory=StoreOptions)


@dataclass(kw_only=True)
class CollectOptions:
    """Options of ``gradtrace collect``."""

    model: Path = field(metadata=cli("Local Hugging Face model directory (config, weights and tokenizer).",
                                     argument=True, metavar="MODEL_DIR"))
    data: Path = field(metadata=cli(DATA_HELP, argument=True, metavar="DATA"))
    store_options: StoreGroup
    data_options: DataOptions
    projection_options: ProjectionOptions
    model_options: ModelOptions
    progress: bool = progress_flag("Show a progress bar and the time profile.")
    dry_run: bool = field(default=False, metadata=cli(
        "Print the plan (examples, tokens, dims and bytes per example, store size against free disk, time) and "
        "stop: nothing is written."))
    force: bool = field(default=False, metadata=cli("Collect even when the planned store exceeds the free disk."))


OPTIONS = CollectOptions


def run(opts: CollectOptions) -> None:
    """Collect per-example gradients of a dataset into a gradient store.

    Each example's gradient is that of its own loss (causal LM, summed over the tokens in its loss: all of a
    text, the completion of a prompt-completion pair, the assistant turns of a conversation; see --loss-on).
    Gradients are projected with LoGra at capture time unless --projection none.

    Example: gradtrace collect ./model train.jsonl --out ./store --rank 16
    """
    import gradtrace

    phases = Phases()
    store_opts, data_opts, model_opts = opts.store_options, opts.data_options, opts.model_options
    already = _check_target(store_opts)
    with phases("load model"):
        tokenizer = load_tokenizer(opts.model)
        device = resolve_device(model_opts.device)
        model = load_model(opts.model, device, model_opts.model_dtype)
    with phases("read data"):
        max_length = resolve_max_length(data_opts.max_length, model)
        batches = read_dataset(opts.data, tokenizer, data_opts, max_length, pad_id(tokenizer))
    phases.note("read data", f"{batches.summary.total_tokens:,} tokens")
    console().print(batches.summary.line(), markup=False, highlight=False, soft_wrap=True)
    single = batches.no_target_ids()  # nothing to predict: a zero gradient
    capture_options = opts.projection_options.capture_options()
    projection, settings = capture_options.projection, store_opts.settings
    if already:
        _check_resume(store_opts, projection, model)
    with phases("plan"):
        planned = gradtrace.plan(model, batches, projection=projection, dtype=settings.dtype, store=store_opts.out,
                                 device=device)
    console().print(plan_lines(planned, store_opts.out), markup=False, highlight=False, soft_wrap=True)
    _check_shard_bytes(settings.shard_bytes, planned.dim, settings.dtype)
    if opts.dry_run:
        return
    if not planned.fits and not opts.force:
        raise CliError(f"the store needs about {human_bytes(planned.store_bytes)} but {store_opts.out} has "
                       f"{human_bytes(planned.free_bytes or 0)} free: free space, choose another --out, store "
                       "--dtype int8 or a smaller --rank, or pass --force")
    final = replace(opts, model=opts.model.absolute(), data=opts.data.absolute(),
                    store_options=replace(store_opts, out=store_opts.out.absolute()),
                    data_options=replace(data_opts, max_length=max_length),
                    model_options=replace(model_opts, device=device))
    values = resolved(final)
    with phases("gradients"), _interrupt_reported(store_opts.out):
        store = gradtrace.collect(model, batches, options=capture_options, store=store_opts.out,
                                  store_options=settings, device=device, progress=opts.progress,
                                  config=record_paths({META_KEY: provenance("collect", opts.data,
                                                                            batches.num_examples), **values},
                                                      store_opts.out))
    seconds = phases.seconds["gradients"]
    phases.note("gradients", f"{batches.num_examples / max(seconds, 1e-9):,.1f} examples/s")
    written = write_resolved(store_opts.out, "collect", values)
    info = store.info()
    out = console()
    new = len(store) - already
    resumed = f" ({already:,} were already stored)" if settings.resume and already else ""
    out.print(f"Stored {new:,} new example{'' if new == 1 else 's'}{resumed} in {store_opts.out}")
    out.print(f"  rows x dim  {len(store):,} x {info['dim']:,} ({info['dtype']}, {human_bytes(info['bytes'])})")
    out.print(f"  projection  {projection_label(info['projection'])}")
    out.print(f"  config      {written}")
    nonfinite = [i for r in store.ranks.values() for i in (r.get("skipped") or {}).get("nonfinite", [])]
    if nonfinite:
        out.print(f"[yellow]Warning: {len(nonfinite)} examples had NaN/inf gradients and were not stored "
                  f"(first ids: {json.dumps(nonfinite[:3])}).[/yellow]")
    if single:
        out.print(f"[yellow]Warning: {len(single)} example{' has' if len(single) == 1 else 's have'} no token in the "
                  "loss (a single token, or nothing after the prompt), so nothing to predict: stored with a zero "
                  f"gradient (first ids: {json.dumps(single[:3])}).[/yellow]")
    out.print(f"Next: gradtrace score {store_opts.out} QUERIES.jsonl --out SCORES_DIR")
    if opts.progress:
        console(stderr=True).print(phases.table())


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


def _check_shard_bytes(shard_bytes: int | None, dim: int, dtype: str) -> None:
    """Refuse, before any gradient, ``--shard-bytes`` smaller than one stored row (naming the row's size)."""
    from ..store.shards import row_bytes

    one = row_bytes(dim, dtype)
    if shard_bytes is not None and shard_bytes < one:
        raise CliError(f"--shard-bytes {shard_bytes:,} is smaller than one row of this store ({one:,} bytes: {dim:,} "
                       f"values in {dtype}); pass --shard-bytes {one:,} or more (default: 256 MiB)")


def plan_lines(planned: Any, out: Path) -> str:
    """The printed plan: what will be collected and what it takes."""
    tokens = "" if planned.tokens is None else f", {planned.tokens:,} tokens"
    free = "" if planned.free_bytes is None else f" ({human_bytes(planned.free_bytes)} free there)"
    return "\n".join([
        f"Plan: {planned.examples:,} examples{tokens}; {planned.params:,} captured parameters",
        f"  per example {planned.dim:,} dims, {human_bytes(planned.bytes_per_example)} ({planned.dtype})",
        f"  store       about {human_bytes(planned.store_bytes)} in {out}{free}",
        f"  time        about {planned.seconds:,.0f} s ({planned.seconds_per_example * 1e3:,.1f} ms/example, "
        "from a warm-up)"])


def _check_target(store_opts: StoreGroup) -> int:
    """Refuse, before any data or model work, a store another run is writing, and an existing store without
    --resume/--overwrite; returns the rows it already holds."""
    out, settings = store_opts.out, store_opts.settings
    if settings.shard_rows is not None and settings.shard_bytes is not None:
        raise CliError("--shard-rows and --shard-bytes both size the shards; pass one of them")
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    _check_writable(out, "--out")
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


def _check_writable(out: Path, flag: str) -> None:
    """Refuse, before any model work, an output directory that cannot be written: a temporary file is created
    (and removed) in it, or in its nearest existing parent when it does not exist yet; nothing is left behind."""
    import tempfile

    folder = out.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a directory")
        handle, probe = tempfile.mkstemp(prefix=".tmp-gradtrace-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise CliError(f"cannot write {flag} {out}: {folder} is not writable ({err.strerror or err}); choose another "
                       f"{flag} or fix the directory's permissions") from None


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

    spec = GradientStore.open(store_opts.out, verify=False, allow_incomplete=True).spec
    wanted = projection.to_dict() if projection is not None else None
    why = resume_mismatch(spec, model=model_fingerprint(model), projection=wanted, example_loss="sum",
                          dtype=store_opts.settings.dtype, describe=projection_label)
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
