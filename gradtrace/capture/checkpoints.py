"""``gradtrace.collect_checkpoints``: the same collection at each of C checkpoints (one store or set per checkpoint).

An ensemble over checkpoints (:class:`gradtrace.Ensemble`) needs each member's training gradients collected at
that member's weights, and its query gradients too. ``collect_checkpoints`` runs :func:`gradtrace.collect` once
per checkpoint with the same arguments (projection, layers, dtype, ...): into ``out/<name>`` (one store each), or
in memory (one :class:`~gradtrace.GradientSet` each: the per-member query sets). Cost: C x one collection, in
time and in store size.

A checkpoint is a Hugging Face model directory (loaded as ``gradtrace collect`` loads one:
:func:`gradtrace.common.model_dir.load_causal_lm`), a state-dict file (``.safetensors`` or a ``torch.save``-d
state dict, read tensors-only and loaded into ``model=``, whose own weights are restored afterwards), or an entry
of :func:`gradtrace.integrations.checkpoints` (its ``path``). Every store records the checkpoint it was collected
at (``config["checkpoint"]``: path, kind, name, weights fingerprint) and, for a model directory,
``config["model"]``: the model ``gradtrace score`` then takes the query gradients with, so the stores make a
command-line ensemble with no ``--model`` per store. An entry of a Trainer run also gives the names of the
optimizer's parameters (``config["checkpoint"]["optimizer_parameters"]``), which map the checkpoint's
``optimizer.pt`` to the model for ``trackstar``; so does a checkpoint directory given by its path, when the
``GradtraceCallback`` of its run saved them there (``gradtrace-optimizer.json``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..common.checkpoints import (
    checkpoint_path,
    load_into,
    read_state_dict,
    restored_weights,
    saved_optimizer_parameter_names,
)
from ..common.errors import UsageError
from ..common.model_dir import is_adapter_dir, load_causal_lm
from ..common.paths import why_missing
from ..common.provenance import record_paths
from ..options import CaptureOptions, RunOptions, StoreOptions
from ..options.base import option_object
from ..projection.logra import per_layer
from ..store import GradientStore, model_fingerprint
from ..store.writer import resolved_store_options
from .collect import check_finite_parameters, check_resumable, collect
from .gradient_set import GradientSet

__all__ = ["Checkpoint", "checkpoint_names", "collect_checkpoints", "finished_store", "resolve_checkpoints"]

WHAT = "collect_checkpoints()"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint to collect at: its path, ``kind`` (``"model_dir"`` or ``"state_dict"``), store name, and the
    names of its optimizer's parameters in their order when its entry carries them (a Trainer run's)."""

    path: Path
    kind: str
    name: str
    optimizer_parameters: tuple[str, ...] | None = None

    def record(self, model: nn.Module) -> dict[str, Any]:
        """What a store collected here records of it (``config["checkpoint"]``)."""
        record = {"path": str(self.path.absolute()), "kind": self.kind, "name": self.name,
                  "weights": model_fingerprint(model)}
        if self.optimizer_parameters is not None:
            record["optimizer_parameters"] = list(self.optimizer_parameters)
        return record


def _path_of(item: Any) -> Path:
    """The path of a checkpoint given as a path or as an entry of ``gradtrace.integrations.checkpoints``."""
    path = checkpoint_path(item)
    if path is not None:
        return path
    raise UsageError(f"{WHAT}: a checkpoint is a model directory, a state-dict file or an entry of "
                     f"gradtrace.integrations.checkpoints(store) (a dict with a 'path'), got {type(item).__name__}")


def checkpoint_names(paths: Sequence[Path], names: Sequence[str] | None = None, *, what: str = WHAT,
                     fix: str = "give them as a mapping {name: checkpoint}") -> list[str]:
    """One store name per checkpoint: ``names`` when given, else each directory's name (``checkpoint-500``) or
    each file's name without its suffix; a name used twice is an error naming it (``what``: who asks, ``fix``:
    what to do)."""
    if names is None:
        chosen = [p.name if p.is_dir() or not p.suffix else p.stem for p in paths]
    else:
        chosen = [str(n) for n in names]
        if len(chosen) != len(paths):
            raise UsageError(f"{WHAT}: {len(chosen)} names for {len(paths)} checkpoints; give one name per checkpoint")
        bad = [n for n in chosen if not n or n in (".", "..") or "/" in n or os.sep in n]
        if bad:
            raise UsageError(f"{WHAT}: store name {bad[0]!r} is not a plain directory name; give names like "
                             "'step-500'")
    twice = sorted({n for n in chosen if chosen.count(n) > 1})
    if twice:
        clash = [str(p) for p, n in zip(paths, chosen) if n == twice[0]]
        raise UsageError(f"{what}: store name {twice[0]!r} would be used for {len(clash)} checkpoints "
                         f"({', '.join(clash)}); {fix}")
    return chosen


def resolve_checkpoints(checkpoints: Sequence[Any], names: Sequence[str] | None = None) -> list[Checkpoint]:
    """The checkpoints, checked before any work: a non-empty list of existing model directories (a
    ``config.json`` in each, or a PEFT adapter's ``adapter_config.json``: loaded on the base it names) or files,
    with distinct names."""
    if isinstance(checkpoints, (str, os.PathLike)) or not checkpoints:
        raise UsageError(f"{WHAT}: give a non-empty list of checkpoints (model directories, state-dict files or "
                         "the entries of gradtrace.integrations.checkpoints(store))")
    paths = [_path_of(item) for item in checkpoints]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:3])})" if len(missing) > 1 else ""
        raise UsageError(f"{WHAT}: checkpoint {missing[0]} {why_missing(missing[0])}{more}; give existing model "
                         "directories or state-dict files")
    not_models = [str(p) for p in paths if p.is_dir() and not (p / "config.json").is_file() and not is_adapter_dir(p)]
    if not_models:
        raise UsageError(f"{WHAT}: {not_models[0]} is a directory without config.json (nor a PEFT adapter's "
                         "adapter_config.json), not a Hugging Face model directory; give the directory "
                         "save_pretrained() wrote, or its state-dict file")
    chosen = checkpoint_names(paths, names)
    return [Checkpoint(p, "model_dir" if p.is_dir() else "state_dict", n, _parameter_names(item))
            for p, n, item in zip(paths, chosen, checkpoints)]


def _parameter_names(item: Any) -> tuple[str, ...] | None:
    """The optimizer parameter names an entry of ``gradtrace.integrations.checkpoints`` carries, else those a
    ``GradtraceCallback`` saved in the checkpoint directory (else None)."""
    names = item.get("optimizer_parameters") if isinstance(item, Mapping) else None
    names = names or saved_optimizer_parameter_names(checkpoint_path(item))
    return tuple(str(n) for n in names) if names else None


def finished_store(target: Path, model: nn.Module, projection: Any, dtype: str) -> GradientStore | None:
    """The complete store at ``target`` (checksums verified), else None (none there, or an interrupted one for
    ``StoreOptions(resume=True)`` to finish). A complete store of other weights, projection or dtype is refused."""
    if not (target / "manifest.json").exists():
        return None
    store = GradientStore.open(target, allow_incomplete=True)
    if not store.complete:
        return None
    check_resumable(store.spec, target, model, projection, dtype)
    return store


def _check_targets(targets: list[Path], resume: bool, overwrite: bool) -> None:
    """Refuse, before any checkpoint is loaded, stores that already exist when neither resume nor overwrite is set."""
    if resume or overwrite:
        return
    there = [str(t) for t in targets if (t / "manifest.json").exists()]
    if there:
        raise UsageError(f"{WHAT}: {', '.join(there)} already hold{'s' if len(there) == 1 else ''} a store: pass "
                         "store_options=StoreOptions(resume=True) to keep finished stores and finish an interrupted "
                         "one, or StoreOptions(overwrite=True)")


@contextlib.contextmanager
def _weights_at(checkpoint: Checkpoint, model: nn.Module | None, dtype: str,
                device: torch.device | str | None) -> Any:
    """The model at the checkpoint's weights: a model directory loaded afresh (on ``device``), or the state-dict
    file loaded into ``model`` (whose weights the caller restores)."""
    if checkpoint.kind == "model_dir":
        loaded = load_causal_lm(checkpoint.path, dtype)
        check_finite_parameters(loaded, what=f"checkpoint {checkpoint.path}")
        yield loaded.to(device) if device is not None else loaded
        return
    assert model is not None
    load_into(model, read_state_dict(checkpoint.path), f"checkpoint {checkpoint.path}")
    yield model


def collect_checkpoints(checkpoints: Sequence[Any] | Mapping[str, Any], data: Iterable[Any], loss: Any = None, *,
                        model: nn.Module | None = None, out: str | Path | None = None,
                        options: CaptureOptions | None = None, store_options: StoreOptions | None = None,
                        run: RunOptions | None = None) -> list[GradientStore] | list[GradientSet]:
    """:func:`gradtrace.collect` at each checkpoint's weights, with the same option objects.

    Args:
        checkpoints: model directories (``save_pretrained``: a causal LM, loaded in ``run.model_dtype`` on
            ``run.device``; a PEFT adapter directory on its base), state-dict files (``.safetensors`` /
            ``torch.save``-d, loaded into ``model``), or the entries of :func:`gradtrace.integrations.checkpoints`
            (their ``path``); a mapping ``{name: checkpoint}`` names the stores (default: each directory's name,
            or each file's name without its suffix).
        data, loss: as for :func:`gradtrace.collect` (``data`` is read once per checkpoint; an iterator is
            turned into a list first).
        model: the model state-dict files are loaded into; its own weights are restored afterwards (also when a
            checkpoint fails).
        out: a directory: one store per checkpoint at ``out/<name>``, returned opened. None: one in-memory
            :class:`~gradtrace.GradientSet` per checkpoint (e.g. each ensemble member's query gradients).
        options, store_options, run: as for :func:`gradtrace.collect`. ``StoreOptions(resume=True)`` keeps every
            complete store (checksums verified, at this checkpoint's weights and projection, else an error)
            without collecting again and finishes an interrupted one; ``store_options.config`` is recorded in
            every store with the checkpoint it was collected at.

    Returns:
        One store (``out`` given) or gradient set per checkpoint, in order.
    """
    options = option_object(options, CaptureOptions, "options")
    store_options = option_object(store_options, StoreOptions, "store_options")
    run = option_object(run, RunOptions, "run")
    names = None
    if isinstance(checkpoints, Mapping):
        names, checkpoints = [str(n) for n in checkpoints], list(checkpoints.values())
    projection, dtype = per_layer(options.projection, WHAT), store_options.store_dtype
    resume, overwrite = store_options.resume, store_options.overwrite
    if out is None and (resume or overwrite):
        raise UsageError(f"{WHAT}: resume/overwrite apply to stores: pass out=DIR")
    entries = resolve_checkpoints(checkpoints, names)
    files = [str(c.path) for c in entries if c.kind == "state_dict"]
    if files and model is None:
        raise UsageError(f"{WHAT}: state-dict file {files[0]} is loaded into a model: pass model=, the model it was "
                         "saved from")
    targets = [Path(out) / c.name for c in entries] if out is not None else [None] * len(entries)
    _check_targets([t for t in targets if t is not None], resume, overwrite)
    if iter(data) is data:
        data = list(data)  # every checkpoint reads it
    user_config = store_options.config
    results: list[Any] = []
    with restored_weights(model if files else None):
        for checkpoint, target in zip(entries, targets):
            with _weights_at(checkpoint, model, run.model_dtype, run.device) as weights:
                dtype = resolved_store_options(target, store_options).dtype
                kept = finished_store(target, weights, projection, dtype) if target is not None and resume else None
                if kept is not None:
                    results.append(kept)
                    continue
                storing = store_options
                if target is not None:
                    record = {**(user_config or {}), "checkpoint": checkpoint.record(weights)}
                    if checkpoint.kind == "model_dir":
                        record["model"] = str(checkpoint.path.absolute())
                    storing = replace(store_options, config=record_paths(record, target))
                results.append(collect(weights, data, loss, store=target, options=options, store_options=storing,
                                       run=run))
    return results
