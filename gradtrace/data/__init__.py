"""Training and query data in: files, ``datasets`` datasets and lists of dicts -> batches for collection.

``gradtrace.data.load(source, tokenizer)`` reads a source (``.jsonl``, ``.json``, ``.parquet``, ``.csv``,
``.txt``, a ``save_to_disk`` directory, a ``datasets.Dataset`` or a list of dicts), detects its format
(``text``, ``prompt-completion``, ``messages``; TRL's conventions), tokenizes it with the loss mask the
model was trained with (completion-only, assistant-only, or every token), and returns a
:class:`TokenizedDataset`: iterate it for ``gradtrace.collect`` batches (``.batches(order)`` for another
order), read ``.ids`` and ``.summary.line()``. Its settings are the option objects of :mod:`gradtrace.options.data`
(``Fields``: which field holds what; ``ReadOptions``: records -> examples; ``BatchOptions``: examples -> batches).
Content-hash ids follow the one rule of :mod:`.ids`, which the capture and the Hugging Face Trainer callback use too.
"""

from .dataset import DataSummary, TokenizedDataset
from .errors import DataError
from .formats import FORMATS, Fields
from .generate import Generate
from .preference import PreferenceDataset, load_preference
from .prepare import display_text, load, texts

__all__ = ["DataError", "DataSummary", "FORMATS", "Fields", "Generate", "PreferenceDataset", "TokenizedDataset",
           "display_text", "load", "load_preference", "texts"]
