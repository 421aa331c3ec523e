"""Checkpoints as state dicts: reading one safely, loading it into a model with clear errors, and restoring the
model's own weights afterwards.

Shared by :meth:`gradtrace.Ensemble.fit` (``checkpoints=``) and :func:`gradtrace.collect_checkpoints`. A checkpoint
is a state dict, a module, a weights file, a checkpoint directory (a Hugging Face ``save_pretrained`` / Trainer
``checkpoint-N`` directory: its ``model.safetensors``, sharded ``model.safetensors.index.json`` or
``pytorch_model.bin``) or an entry of :func:`gradtrace.integrations.checkpoints` (its ``path``). Files are read
tensors-only (``.safetensors``, or ``torch.load(weights_only=True)``): no pickled code runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .errors import UsageError
from .paths import why_missing

__all__ = ["OPTIMIZER_NAMES_FILE", "WEIGHT_FILES", "checkpoint_path", "load_into", "read_state_dict",
           "restored_weights", "saved_optimizer_parameter_names"]

OPTIMIZER_NAMES_FILE = "gradtrace-optimizer.json"
"""Written by ``GradtraceCallback`` into every checkpoint directory the Trainer saves: the names of the optimizer's
parameters in its order (``{"optimizer_parameters": [...]}``), which map that directory's ``optimizer.pt`` -- whose
parameter groups (the Trainer's weight-decay groups) list parameters by position only -- to the model's."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""The weights of a checkpoint directory, in the order they are looked for (``save_pretrained``'s names)."""


def checkpoint_path(checkpoint: Any) -> Path | None:
    """The path of a checkpoint given as a path or as an entry of :func:`gradtrace.integrations.checkpoints` (a
    dict whose ``path`` is a string, where a state dict maps names to tensors); None for a state dict or module."""
    if isinstance(checkpoint, (str, os.PathLike)):
        return Path(checkpoint)
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("path"), (str, os.PathLike)):
        return Path(checkpoint["path"])
    return None


def saved_optimizer_parameter_names(location: Any) -> list[str] | None:
    """The optimizer parameter names ``GradtraceCallback`` saved beside a checkpoint's ``optimizer.pt``
    (:data:`OPTIMIZER_NAMES_FILE` in the directory, or next to the file, ``location`` names); None when ``location``
    is not a path or holds none. An unreadable or malformed file is an error naming it (never ignored: the names
    decide which second moment belongs to which parameter)."""
    if not isinstance(location, (str, os.PathLike)):
        return None
    path = Path(location)
    path = (path if path.is_dir() else path.parent) / OPTIMIZER_NAMES_FILE
    if not path.is_file():
        return None
    try:
        names = json.loads(path.read_text()).get("optimizer_parameters")
    except (OSError, ValueError, AttributeError) as err:
        raise UsageError(f"{path} is not readable ({err}); delete it and pass param_names= (the names of the "
                         "optimizer's parameters in order)") from None
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{path} lists no parameter names; delete it and pass param_names= (the names of the "
                         "optimizer's parameters in order)")
    return names


def read_state_dict(checkpoint: Any) -> Mapping[str, Tensor]:
    """A checkpoint as a state dict: given as one (or a module's), or read from a ``.safetensors`` file, a
    ``torch.save``-d state dict (``weights_only=True``: no pickled code runs) or a checkpoint directory
    (:data:`WEIGHT_FILES`)."""
    path = checkpoint_path(checkpoint)
    if path is None:
        if isinstance(checkpoint, nn.Module):
            return checkpoint.state_dict()
        if isinstance(checkpoint, Mapping) and "path" in checkpoint and not isinstance(checkpoint["path"], Tensor):
            raise UsageError(f"checkpoint entry {dict(checkpoint)!r} has no path to its weights; give entries of "
                             "gradtrace.integrations.checkpoints(store) whose checkpoint was saved, or a path")
        if isinstance(checkpoint, Mapping):
            return checkpoint
        raise UsageError(f"a checkpoint is a state dict, a weights file, a checkpoint directory or an entry of "
                         f"gradtrace.integrations.checkpoints(store), got {type(checkpoint).__name__}")
    if not path.exists():
        raise UsageError(f"checkpoint {path} {why_missing(path)}")
    if path.is_dir():
        return _read_directory(path)
    return _read_file(path)


def _read_file(path: Path) -> Mapping[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(f"refusing to load {path}: it holds pickled Python objects besides tensors (they could run "
                         "code when loaded) and gradtrace loads weights only; save a state dict of tensors, or "
                         "safetensors") from None


def _read_directory(path: Path) -> Mapping[str, Tensor]:
    """The weights of a ``save_pretrained`` / Trainer checkpoint directory: one file, or the shards its
    ``model.safetensors.index.json`` lists."""
    name = next((n for n in WEIGHT_FILES if (path / n).is_file()), None)
    if name is None:
        raise UsageError(f"checkpoint directory {path} holds no model weights (none of {', '.join(WEIGHT_FILES)}); "
                         "give the directory save_pretrained() or the Trainer wrote, or a weights file")
    if not name.endswith(".index.json"):
        return _read_file(path / name)
    shards = sorted(set(json.loads((path / name).read_text()).get("weight_map", {}).values()))
    missing = [s for s in shards if not (path / s).is_file()]
    if not shards or missing:
        raise UsageError(f"checkpoint directory {path}: {name} lists "
                         f"{'no shards' if not shards else f'shard {missing[0]}, which is missing'}")
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(_read_file(path / shard))
    return state


def _tied_aliases(model: nn.Module) -> dict[str, set[str]]:
    """``{state-dict key: the other keys holding the same tensor}`` (tied weights such as ``lm_head.weight`` and
    ``transformer.wte.weight``: a checkpoint saved with one of them holds both)."""
    by_tensor: dict[tuple[int, int, tuple[int, ...]], set[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and value.numel():
            by_tensor.setdefault((value.data_ptr(), value.storage_offset(), tuple(value.shape)), set()).add(key)
    return {key: group - {key} for group in by_tensor.values() for key in group}


def load_into(model: nn.Module, state: Mapping[str, Tensor], what: str) -> None:
    """Load ``state`` into ``model``; a key the model lacks, a key of the model the state lacks (a tied weight
    given once is enough) or a tensor of another shape is a :class:`UsageError` naming them (``what``: the
    checkpoint, as the message calls it)."""
    wanted = model.state_dict()
    aliases = _tied_aliases(model)
    missing = [k for k in wanted if k not in state and not (aliases.get(k, set()) & state.keys())]
    unexpected = [k for k in state if k not in wanted]
    if missing or unexpected:
        parts = [f"{len(keys)} {label} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise UsageError(f"{what} does not fit the model: {'; '.join(parts)} keys. Pass the model it was saved "
                         "from (the same architecture and parameter names)")
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(wanted[k].shape)}" for k in state
              if tuple(state[k].shape) != tuple(wanted[k].shape)]
    if shapes:
        raise UsageError(f"{what} does not fit the model: {len(shapes)} tensors of other shapes ({shapes[0]}). Pass "
                         "the model it was saved from")
    model.load_state_dict(state, strict=False)


@contextlib.contextmanager
def restored_weights(model: nn.Module | None) -> Iterator[None]:
    """Within the block the model's weights may be replaced (checkpoints loaded into it); on exit, even by an
    error, its own weights are loaded back. ``None``: nothing to restore."""
    if model is None:
        yield
        return
    original = {name: value.detach().clone() for name, value in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(original)
