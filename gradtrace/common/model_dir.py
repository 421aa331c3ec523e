"""Local Hugging Face model directories: checking one, loading its causal LM and its tokenizer quietly.

A model directory is a full model (``save_pretrained``: ``config.json`` and weights) or a PEFT adapter
(``PeftModel.save_pretrained``, also a LoRA Trainer's ``checkpoint-N``: ``adapter_config.json`` and the adapter
weights), loaded onto its base model with ``is_trainable=True`` -- the adapter weights are the trainable ones, as
in training, so a store captured then matches. The base is ``base_model`` when given (``--base-model``), else the
local directory ``adapter_config.json`` names; never the hub.

Shared by the commands (:func:`gradtrace.cli.load_model.load_model` adds the NaN/inf check), by
:func:`gradtrace.collect_checkpoints` (one model directory per checkpoint) and by the report (which reads a
dataset's texts under the ids its tokenizer gave them). Errors are :class:`~.errors.UsageError`.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError, first_line
from .paths import why_missing

__all__ = ["ADAPTER_CONFIG", "TOKENIZER_FILES", "adapter_base", "check_model_dir", "is_adapter_dir", "load_causal_lm",
           "load_tokenizer", "quiet_loading"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def check_model_dir(path: Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` when it is a model directory (a ``config.json`` in it) or a PEFT adapter
    directory (an ``adapter_config.json``), else an error."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"model directory {path} {why_missing(path)} (models are loaded from local directories only)")
    if not path.is_dir():
        raise UsageError(f"model {path} is not a directory; give a directory written by save_pretrained()")
    if not (path / "config.json").is_file() and not is_adapter_dir(path):
        raise UsageError(f"{path} is not a Hugging Face model directory (no config.json) nor a PEFT adapter "
                         f"directory (no {ADAPTER_CONFIG})")
    return path


def is_adapter_dir(path: Path) -> bool:
    """Whether ``path`` holds a PEFT adapter (``adapter_config.json``: ``PeftModel.save_pretrained``, a LoRA
    Trainer's ``checkpoint-N``), loaded onto its base model rather than as a model of its own."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: Path, base_model: Path | None = None) -> Path | None:
    """The base model directory of PEFT adapter directory ``path`` (None for a full model directory):
    ``base_model`` when given, else the ``base_model_name_or_path`` of its ``adapter_config.json`` when that is a
    local model directory (as written, else relative to ``path``). A hub name is an error naming ``--base-model``:
    the hub is never contacted."""
    path = Path(path)
    if not is_adapter_dir(path):
        if base_model is not None:
            raise UsageError(f"--base-model {base_model}: {path} is a full model directory (config.json, no "
                             f"{ADAPTER_CONFIG}), not a PEFT adapter; drop --base-model")
        return None
    if base_model is not None:
        base = Path(base_model)
        if not base.exists():
            raise UsageError(f"--base-model {base} {why_missing(base)} (models are loaded from local directories "
                             "only)")
        if not (base / "config.json").is_file():
            raise UsageError(f"--base-model {base} is not a Hugging Face model directory (no config.json)")
        return base
    try:
        named = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as err:
        raise UsageError(f"cannot read {path / ADAPTER_CONFIG}: {first_line(err)}") from None
    if not named or not isinstance(named, str):
        raise UsageError(f"PEFT adapter {path} does not name its base model (no base_model_name_or_path in "
                         f"{ADAPTER_CONFIG}): pass --base-model DIR, the base model's local directory")
    for candidate in dict.fromkeys((Path(named).expanduser(), path / Path(named).expanduser())):
        if (candidate / "config.json").is_file():
            return candidate
    raise UsageError(f"the base model of PEFT adapter {path}, {named!r} (base_model_name_or_path in "
                     f"{ADAPTER_CONFIG}), is not a local model directory, and models are loaded from local "
                     "directories only: pass --base-model DIR, a local copy of that model")


def load_causal_lm(path: Path, dtype: str = "float32", base_model: Path | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` in ``dtype`` (``float32``,
    ``bfloat16``, ``float16``, or ``auto``: the dtype its config names), on the CPU.

    A PEFT adapter directory is loaded onto its base model (:func:`adapter_base`; ``base_model``: that directory,
    overriding the one ``adapter_config.json`` names) with ``PeftModel.from_pretrained(base, path,
    is_trainable=True)``: the adapter weights are the trainable parameters, as in training, so what is captured is
    what a ``GradtraceCallback`` captured then. The model is returned in eval mode either way (no dropout).

    Pickled weight files are loaded tensors-only: one holding other Python objects (which could run code) is
    refused with a :class:`UsageError`, as is a directory transformers cannot load."""
    path = check_model_dir(path)
    base = adapter_base(path, base_model)
    if base is None:
        return _from_pretrained(path, dtype)
    return _with_adapter(_from_pretrained(base, dtype), path, base)


def _with_adapter(model: Any, path: Path, base: Path) -> Any:
    """``model`` (the base) with the PEFT adapter of ``path`` on it, its adapter weights trainable."""
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):  # peft would look for them on the hub
        raise UsageError(f"PEFT adapter {path} holds no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    try:
        from peft import PeftModel
    except ImportError:
        raise UsageError(f"{path} is a PEFT adapter directory ({ADAPTER_CONFIG}); loading it needs peft "
                         "(pip install peft)") from None
    try:
        with quiet_loading(), warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return PeftModel.from_pretrained(model, str(path), is_trainable=True).eval()
    except pickle.UnpicklingError:
        raise UsageError(f"refusing to load {path}: adapter_model.bin holds pickled Python objects besides tensors "
                         "(they could run code when loaded) and gradtrace loads weights only; save the adapter as "
                         "safetensors") from None
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # RuntimeError: shapes of another base model
        raise UsageError(f"cannot load PEFT adapter {path} onto base model {base}: {first_line(err)}") from None


def _from_pretrained(path: Path, dtype: str) -> Any:
    """The causal LM of full model directory ``path`` (:func:`load_causal_lm`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kwarg = {"dtype": torch_dtype} if major_minor >= (4, 56) else {"torch_dtype": torch_dtype}
    try:
        with quiet_loading():
            return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **dtype_kwarg)
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(f"cannot load a causal language model from {path}: {first_line(err)}") from None
    except pickle.UnpicklingError:
        files = ", ".join(p.name for p in _pickle_files(path)) or "its weight file"
        raise UsageError(f"refusing to load {path}: {files} holds pickled Python objects besides tensors (they could "
                         "run code when loaded) and gradtrace loads weights only; get the model as safetensors from a "
                         "source you trust") from None


def _pickle_files(path: Path) -> list[Path]:
    """The pickle-based weight files of a model directory (``pytorch_model*.bin``, ``*.pt``, ``*.pth``)."""
    return sorted(p for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern))


def load_tokenizer(path: Path, base_model: Path | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; a directory without one is an error. A PEFT
    adapter directory without a tokenizer gives its base model's (:func:`adapter_base`, ``base_model`` as there)."""
    path = check_model_dir(path)
    if is_adapter_dir(path) and not any((path / name).is_file() for name in TOKENIZER_FILES):
        path = adapter_base(path, base_model) or path  # the base model's tokenizer
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); "
                         "save one there with tokenizer.save_pretrained() (a Trainer saves it in every "
                         "checkpoint-N when given processing_class=tokenizer), or pass --tokenizer DIR on the command "
                         "line")
    from transformers import AutoTokenizer

    try:
        with quiet_loading():
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(f"cannot load the tokenizer of {path}: {first_line(err)}") from None


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence loading chatter: stdout prints and transformers' weight-loading progress bar."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()
