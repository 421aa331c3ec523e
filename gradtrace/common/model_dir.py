"""Local Hugging Face model directories: checking one, loading its causal LM and its tokenizer quietly.

Shared by the commands (:func:`gradtrace.cli.load_model.load_model` adds the NaN/inf check), by
:func:`gradtrace.collect_checkpoints` (one model directory per checkpoint) and by the report (which reads a
dataset's texts under the ids its tokenizer gave them). Errors are :class:`~.errors.UsageError`.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError, first_line
from .paths import why_missing

__all__ = ["TOKENIZER_FILES", "check_model_dir", "load_causal_lm", "load_tokenizer", "quiet_loading"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")


def check_model_dir(path: Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` when it is a model directory (a ``config.json`` in it), else an error."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"model directory {path} {why_missing(path)} (models are loaded from local directories only)")
    if not path.is_dir():
        raise UsageError(f"model {path} is not a directory; give a directory written by save_pretrained()")
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def load_causal_lm(path: Path, dtype: str = "float32") -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` in ``dtype`` (``float32``,
    ``bfloat16``, ``float16``, or ``auto``: the dtype its config names), on the CPU.

    Pickled weight files are loaded tensors-only: one holding other Python objects (which could run code) is
    refused with a :class:`UsageError`, as is a directory transformers cannot load."""
    path = check_model_dir(path)
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


def load_tokenizer(path: Path) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; a directory without one is an error."""
    path = check_model_dir(path)
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
