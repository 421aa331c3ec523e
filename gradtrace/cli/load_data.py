"""The commands' data: :func:`gradtrace.data.load` with the ``Data`` options (one place for collect, fit and
score); the texts of a dataset for ``gradtrace topk`` come from :func:`gradtrace.data.prepare.dataset_texts`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data_warnings import data_warnings_shown
from .groups import DataOptions

__all__ = ["data_warnings_shown", "read_dataset"]


def read_dataset(path: Path, tokenizer: Any, opts: DataOptions, max_length: int | None, pad_id: int, *,
                 what: str = "data", generate: Any = None) -> Any:
    """Read, check and tokenize ``path`` into a :class:`gradtrace.data.TokenizedDataset` of batches
    (``generate``: a :class:`gradtrace.data.Generate` to answer its prompts with the model)."""
    from ..data import load

    return load(path, tokenizer, fields=opts.record_fields(), read_options=opts.read_options(max_length),
                batch_options=opts.batch_options(pad_id), generate=generate, what=what)
