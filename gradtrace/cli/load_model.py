"""Loading a local Hugging Face model directory (never a hub), with clear errors for what is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..capture.collect import NonFiniteError, check_finite_parameters
from ..common.model_dir import load_causal_lm, load_tokenizer
from ..common.modules import context_limit
from .errors import CliError

__all__ = ["context_limit", "load_model", "load_tokenizer", "pad_id", "recorded_model", "resolve_device",
           "resolve_max_length", "tokenizer_dir"]


def recorded_model(store: Any) -> Path:
    """The model directory ``store`` records (the one it was collected with), for a command given no ``--model``.

    A store a ``GradtraceCallback`` wrote records the Trainer's output directory, which holds a model only once the
    final one is saved there: without it the error names the two fixes."""
    from ..common.provenance import resolve_paths

    recorded = resolve_paths(store.manifest.get("config") or {}, store.root).get("model")
    if not recorded:
        raise CliError(f"store {store.root} does not record the model it was collected with: pass --model MODEL_DIR")
    if (store.manifest.get("config") or {}).get("trainer") and not (Path(recorded) / "config.json").exists():
        raise CliError(f"store {store.root} was written during training with output dir {recorded}, which holds "
                       "no saved model: save the final model there (trainer.save_model() after train()) or pass "
                       f"--model {recorded}/checkpoint-STEP")
    return Path(recorded)


def tokenizer_dir(given: Path | None, store: Any, model_dir: Path) -> Path:
    """The directory whose tokenizer a command reads text with: ``--tokenizer`` when given, else the one ``store``
    records (``gradtrace collect --tokenizer``: the same tokenization as its gradients), else the model's."""
    if given is not None:
        return given
    if store is not None:
        from ..common.provenance import resolve_paths

        recorded = resolve_paths(store.manifest.get("config") or {}, store.root).get("tokenizer")
        if recorded:
            return Path(recorded)
    return model_dir


def load_model(path: Path, device: str, dtype: str = "float32") -> torch.nn.Module:
    """The causal LM of model directory ``path`` (:func:`gradtrace.common.model_dir.load_causal_lm`: local files
    only, pickles refused) on ``device``; a model with a NaN/inf parameter is refused (every gradient through it
    would be broken)."""
    model = load_causal_lm(path, dtype)
    try:
        check_finite_parameters(model, what=f"model {path}")
    except NonFiniteError as err:
        raise CliError(str(err)) from None
    return model.to(device)


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
