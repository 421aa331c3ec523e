"""Local Hugging Face model directories: checking one, and loading its tokenizer quietly.

Shared by the commands (which also load the model, :func:`gradtrace.cli.models.load_model`) and the report (which
reads a dataset's texts under the ids its tokenizer gave them). Errors are :class:`~.errors.UsageError`.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError, first_line

__all__ = ["TOKENIZER_FILES", "check_model_dir", "load_tokenizer", "quiet_loading"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")


def check_model_dir(path: Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` when it is a model directory (a ``config.json`` in it), else an error."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"model directory {path} does not exist (models are loaded from local directories only)")
    if not path.is_dir():
        raise UsageError(f"model {path} is not a directory; give a directory written by save_pretrained()")
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def load_tokenizer(path: Path) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; a directory without one is an error."""
    path = check_model_dir(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); "
                         "save one there with tokenizer.save_pretrained()")
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
