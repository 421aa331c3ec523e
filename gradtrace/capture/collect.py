"""``gradtrace.collect``: per-example gradients of a dataset at the current weights (no training).

Attribution needs per-example gradients, not ``param.grad``. So by default ``collect`` backpropagates only
to the captured layers' *outputs* (``torch.autograd.grad(loss, outputs)``): every capture hook fires, and
the weight-gradient matrix products of the backward pass -- about half its cost, the whole ``lm_head``
one included -- are never computed. ``param.grad`` is left untouched.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..loss.functions import LossFn
from ..options import CaptureOptions, Loss, RunOptions, StoreOptions, with_record
from ..options.base import option_object
from ..projection.logra import LoGra, per_layer
from ..store import GradientStore, ShardWriter, SpecMismatch, model_fingerprint
from ..store.spec import GradientSpec, resume_mismatch
from ..store.writer import resolved_store_options
from . import CaptureCallback, capture
from .driver import run_capture
from .gradient_set import GradientSet
from .sink import StoreWriter

__all__ = ["Interrupted", "NonFiniteError", "check_finite_parameters", "check_resumable", "collect",
           "nonfinite_parameters", "terminate_as_interrupt"]

class NonFiniteError(ValueError):
    """NaN/inf where gradients need finite numbers: in the model's parameters, or in every example's gradient."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGTERM (as by Ctrl-C): the store it was writing was closed as interrupted, every row
    written so far committed. ``signum``: the signal received."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Interrupted` in the main thread (as SIGINT raises
    ``KeyboardInterrupt``), so that a store being written is closed cleanly -- its open shard committed and
    the store marked interrupted -- instead of the process dying with the shard's rows. Only when SIGTERM has
    its default action and this is the main thread; a handler of the caller's is left alone. Further SIGTERMs
    while the store closes are ignored (the close is short)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the clean-up finish
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def nonfinite_parameters(model: nn.Module) -> list[str]:
    """Names of the model's floating-point parameters that hold a NaN or an inf (this process's shard under
    FSDP2). One host read per device the parameters are on (not one per parameter): a flag per parameter is
    reduced on its device and read once."""
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.is_meta:
            continue
        local = (param.to_local() if hasattr(param, "to_local") else param).detach()
        flags.setdefault(local.device, []).append((name, torch.isfinite(local).all()))
    bad = []
    for entries in flags.values():
        finite = torch.stack([flag for _, flag in entries]).tolist()
        bad += [name for (name, _), ok in zip(entries, finite) if not ok]
    return bad


def check_finite_parameters(model: nn.Module, what: str = "collect()") -> None:
    """Refuse a model with NaN/inf parameters before any work (naming them): gradients through them are NaN."""
    bad = nonfinite_parameters(model)
    if bad:
        more = ""
        if len(bad) > 1:
            more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})"
        raise NonFiniteError(f"{what}: the model's parameter {bad[0]} holds NaN/inf{more}; gradients taken through "
                             "it are NaN or meaningless. Load intact weights (the checkpoint, or the training that "
                             "wrote it, is broken)")


def check_resumable(stored: GradientSpec, store: str | Path, model: nn.Module, projection: LoGra | None,
                    dtype: str) -> None:
    """Refuse, before any gradient is taken, to resume a store collected with other model weights, another
    projection, another per-example loss or another storage dtype (naming what differs)."""
    wanted = projection.to_dict() if projection is not None else None
    why = resume_mismatch(stored, model=model_fingerprint(model), projection=wanted, example_loss="sum", dtype=dtype)
    if why is not None:
        raise SpecMismatch(f"cannot resume {store}: {why}. Resume with the settings that started it, or write to "
                           "a new directory or pass StoreOptions(overwrite=True); rows of the two runs are never mixed")


class _NonFiniteTally(CaptureCallback):
    """Capture callback counting the examples of a run and the ids flagged NaN/inf."""

    def __init__(self) -> None:
        self.examples = 0
        self.nonfinite: list[str] = []

    def on_batch(self, batch: Any, capture: Any) -> None:
        self.examples += len(batch)
        if batch.nonfinite is not None and bool(batch.nonfinite.any()):
            self.nonfinite += [batch.ids[i] for i in batch.nonfinite.nonzero().flatten().tolist()]

    def check(self, kept: str) -> None:
        """Raise when every example of the run was non-finite (nothing new to return or store)."""
        if self.examples and len(self.nonfinite) == self.examples:
            first = ", ".join(self.nonfinite[:3]) + (" ..." if self.examples > 3 else "")
            raise NonFiniteError(f"collect(): all {self.examples} examples have NaN/inf gradients ({first}); {kept}. "
                                 "Check the data and the model's dtype (float16/bfloat16 can overflow)")


def collect(model: nn.Module, data: Iterable[Any], loss: Loss | LossFn | None = None, *,
            store: str | Path | None = None, options: CaptureOptions | None = None,
            store_options: StoreOptions | None = None,
            run: RunOptions | None = None) -> GradientSet | GradientStore:
    """Per-example gradients of every example of ``data`` at the model's current weights.

    Examples whose gradient holds NaN/inf are left out with a warning naming them (in-memory: listed in the
    result's ``dropped``; in a store: in its rank status). A model with a NaN/inf parameter, or a run where every
    example is non-finite, raises :class:`NonFiniteError`; examples without a target token (one token) get a zero
    gradient and a warning.

    Args:
        model: the model (not modified; ``param.grad`` untouched).
        data: an iterable of batches: dicts of tensors (Hugging Face style) or ``(inputs, targets)`` tuples.
        loss: the per-example loss (:class:`gradtrace.Loss`, or its ``fn`` alone): each gradient is that of the
            example's own loss, summed over its target tokens (``example_loss="sum"``; collect sums the examples
            itself, so ``reduction`` and ``scale`` must be left unset).
        store: write a gradient store at this path (returned opened) instead of returning a :class:`GradientSet`.
            SIGTERM or Ctrl-C while writing commits every row captured so far, marks the store interrupted and
            raises ``KeyboardInterrupt`` (:class:`Interrupted` for SIGTERM); ``StoreOptions(resume=True)``
            continues it.
        options: what is captured (:class:`gradtrace.CaptureOptions`: projection, layers, exclude, keep_tokens...;
            ``isolate_padding`` is always on: padding's NaN/inf never reaches an example's gradient).
        store_options: how the store is written (:class:`gradtrace.StoreOptions`).
        run: ids, device, eval mode, weight gradients, progress (:class:`gradtrace.RunOptions`).

    Returns:
        the :class:`GradientSet` (in memory), or the written :class:`GradientStore`. The resolved option objects
        are recorded in the store's manifest (``config["gradtrace"]["options"]``).
    """
    options = option_object(options, CaptureOptions, "options")
    store_options = option_object(store_options, StoreOptions, "store_options")
    run = option_object(run, RunOptions, "run")
    loss = Loss.of(loss).summed("collect()")
    store_options = resolved_store_options(store, store_options)
    if store is None and (store_options.resume or store_options.overwrite):
        raise ValueError("resume/overwrite apply to a store: pass store=...")
    check_finite_parameters(model)
    projection = per_layer(options.projection, "collect()")
    config = with_record(store_options.config, capture=options, store=store_options, loss=loss)
    writer = StoreWriter(store, replace(store_options, config=config)) if store is not None else None
    stored: set[str] = set()
    if store is not None and store_options.resume and (Path(store) / "manifest.json").exists():
        existing = GradientStore.open(store, verify=False, allow_incomplete=True)
        check_resumable(existing.spec, store, model, projection, store_options.dtype)
        stored = set(existing.ids)
    tally = _NonFiniteTally()
    # padding's NaN/inf must not reach the real tokens (isolate_padding): each example's gradient is its own
    cap = capture(model, replace(loss, fn=None, reduction="sum"), options=replace(options, isolate_padding=True),
                  callbacks=[writer, tally] if writer is not None else [tally], keep_batches=writer is None)
    with terminate_as_interrupt() if writer is not None else contextlib.nullcontext():
        run_capture(model, data, loss.fn, cap, run, skip=stored)
    tally.check(f"nothing new was stored in {store} (it keeps what it held)" if store is not None
                else "no gradient is left")
    if writer is not None:
        if writer.writer is None:
            if not stored:
                raise ValueError("collect(): the data produced no examples")
            # resumed with nothing left to compute: mark this rank's part of the store complete
            existing = GradientStore.open(store, verify=False, allow_incomplete=True)
            ShardWriter(store, existing.spec, StoreOptions(resume=True)).close()
        return GradientStore.open(store)
    if not cap.batches:
        raise ValueError("collect(): the data produced no examples")
    return GradientSet.from_batches(cap.batches, model_fingerprint(model), keep_batches=options.keep_tokens)

