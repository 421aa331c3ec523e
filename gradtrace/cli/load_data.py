"""The commands' data: :func:`gradtrace.data.load` with the ``Data`` options (one place for collect, fit and
score); the texts of a dataset for ``gradtrace topk`` come from :func:`gradtrace.data.prepare.dataset_texts`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data_warnings import data_warnings_shown
from .groups import DataOptions

__all__ = ["data_kwargs", "data_warnings_shown", "read_dataset"]


def data_kwargs(opts: DataOptions) -> dict[str, Any]:
    """The ``gradtrace.data.load`` keyword arguments that select and read the examples."""
    return {"format": opts.data_format, "split": opts.split, "text_field": opts.text_field,
            "prompt_field": opts.prompt_field, "completion_field": opts.completion_field,
            "messages_field": opts.messages_field, "id_field": opts.id_field, "loss_on": opts.loss_on,
            "add_eos": opts.eos}


def read_dataset(path: Path, tokenizer: Any, opts: DataOptions, max_length: int | None, pad_id: int, *,
                 what: str = "data", generate: Any = None) -> Any:
    """Read, check and tokenize ``path`` into a :class:`gradtrace.data.TokenizedDataset` of batches
    (``generate``: a :class:`gradtrace.data.Generate` to answer its prompts with the model)."""
    from ..data import load

    return load(path, tokenizer, max_length=max_length, truncate=opts.truncate, batch_size=opts.batch_size,
                pad_id=pad_id, what=what, generate=generate, **data_kwargs(opts))
