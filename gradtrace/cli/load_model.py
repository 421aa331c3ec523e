"""Loading a local Hugging Face model directory (never a hub), with clear errors for what is missing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.model_dir import is_adapter_dir, load_causal_lm, load_tokenizer
from .errors import CliError

if TYPE_CHECKING:
    import torch  # imported where a model is loaded or a device resolved: the commands' --help needs no torch

__all__ = ["base_model_dir", "load_model", "load_tokenizer", "pad_id", "recorded_model",
           "resolve_device", "resolve_max_length", "tokenizer_dir"]


def recorded_model(store: Any) -> Path:
    """The model directory ``store`` records (the one it was collected with), for a command given no ``--model``.

    A store a ``GradtraceCallback`` wrote records the Trainer's output directory, which holds a model only once the
    final one is saved there (a full model, or a LoRA run's adapter): without it the error names the two fixes."""
    from ..common.provenance import resolve_paths

    recorded = resolve_paths(store.manifest.get("config") or {}, store.root).get("model")
    if not recorded:
        raise CliError(f"store {store.root} does not record the model it was collected with: pass --model MODEL_DIR")
    saved = (Path(recorded) / "config.json").exists() or is_adapter_dir(Path(recorded))
    if (store.manifest.get("config") or {}).get("trainer") and not saved:
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


def base_model_dir(given: Path | None, store: Any, model_dir: Path) -> Path | None:
    """The base model of ``model_dir`` when that is a PEFT adapter directory: ``--base-model`` when given, else the
    one ``store`` records (the base it was collected on), else None (the one its ``adapter_config.json`` names)."""
    if given is not None or store is None or not is_adapter_dir(model_dir):
        return given
    from ..common.provenance import resolve_paths

    recorded = resolve_paths(store.manifest.get("config") or {}, store.root).get("base_model")
    return Path(recorded) if recorded else None


def load_model(path: Path, device: str, dtype: str = "float32", base_model: Path | None = None) -> torch.nn.Module:
    """The causal LM of model directory ``path`` (:func:`gradtrace.common.model_dir.load_causal_lm`: local files
    only, pickles refused; a PEFT adapter directory on its base model, ``base_model`` or the one it names, adapter
    weights trainable) on ``device``; a model with a NaN/inf parameter is refused (every gradient through it would
    be broken)."""
    from ..capture.collect import NonFiniteError, check_finite_parameters

    model = load_causal_lm(path, dtype, base_model)
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
    import torch

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
    from ..common.modules import context_limit

    limit = context_limit(model)
    if requested is None:
        return limit
    if requested < 2:
        raise CliError(f"--max-length {requested}: an example needs at least 2 tokens (one target)")
    if limit is not None and requested > limit:
        raise CliError(f"--max-length {requested} is longer than the model's context ({limit} tokens)")
    return requested
