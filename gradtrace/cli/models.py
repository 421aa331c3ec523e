"""Loading a local Hugging Face model directory (never a hub), with clear errors for what is missing."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ..collect import NonFiniteError, check_finite_parameters
from ..common.errors import first_line as _first_line
from ..common.model_dir import check_model_dir as _check_dir
from ..common.model_dir import load_tokenizer
from ..common.model_dir import quiet_loading as _quiet
from ..common.models import context_limit
from .errors import CliError

__all__ = ["context_limit", "load_model", "load_tokenizer", "pad_id", "resolve_device", "resolve_max_length"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: Path, device: str, dtype: str = "float32") -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` on ``device``.

    Pickled weight files are loaded tensors-only: one holding other Python objects (which could run code) is
    refused, as is a model with a NaN/inf parameter (every gradient through it would be broken)."""
    path = _check_dir(path)
    import transformers
    from transformers import AutoModelForCausalLM

    if dtype == "auto":
        torch_dtype: Any = "auto"
    else:
        torch_dtype = TORCH_DTYPES[dtype]
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kwarg = {"dtype": torch_dtype} if major_minor >= (4, 56) else {"torch_dtype": torch_dtype}
    try:
        with _quiet():
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **dtype_kwarg)
    except (OSError, ValueError, KeyError) as err:
        raise CliError(f"cannot load a causal language model from {path}: {_first_line(err)}") from None
    except pickle.UnpicklingError:
        files = ", ".join(p.name for p in _pickle_files(path)) or "its weight file"
        raise CliError(f"refusing to load {path}: {files} holds pickled Python objects besides tensors (they could run "
                       "code when loaded) and gradtrace loads weights only; get the model as safetensors from a "
                       "source you trust") from None
    try:
        check_finite_parameters(model, what=f"model {path}")
    except NonFiniteError as err:
        raise CliError(str(err)) from None
    return model.to(device)


def _pickle_files(path: Path) -> list[Path]:
    """The pickle-based weight files of a model directory (``pytorch_model*.bin``, ``*.pt``, ``*.pth``)."""
    return sorted(p for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern))


def pad_id(tokenizer: Any) -> int:
    """Padding token id (any id works: padded positions are masked); the pad, else EOS, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; other values are checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise CliError(f"--device {device!r}: {err}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device}: CUDA is not available on this machine")
    return device


def resolve_max_length(requested: int | None, model: torch.nn.Module) -> int | None:
    """``--max-length``: the model's context when not given; more than the context is an error."""
    limit = context_limit(model)
    if requested is None:
        return limit
    if requested < 2:
        raise CliError(f"--max-length {requested}: an example needs at least 2 tokens (one target)")
    if limit is not None and requested > limit:
        raise CliError(f"--max-length {requested} is longer than the model's context ({limit} tokens)")
    return requested
