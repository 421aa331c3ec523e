"""Datasets for the command line: JSONL or plain-text files -> tokenized, identified, padded batches.

* ``.jsonl`` (also ``.ndjson``): one JSON object per line; the text is under ``--text-field`` (default
  ``text``), the optional id under ``--id-field`` (default ``id``). Blank lines are skipped.
* ``.txt``: one example per non-empty line.

Ids: the id field when the records have one (all of them or none), else the library's content hash of
the example's tokens (as ``gradtrace.capture`` computes it: 16 hex digits, ``#n`` appended to the n-th
repeat of the same content), so stores written from Python and from the command line agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CliError

__all__ = ["Batches", "Example", "make_batches", "read_examples", "text_index", "token_ids"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt",)
TOKENIZE_CHUNK = 1024


@dataclass
class Example:
    """One example: its text, its user id (None: content hash), and where it came from (1-based line)."""

    text: str
    id: str | None
    line: int


def read_examples(path: Path, text_field: str = "text", id_field: str = "id", *, what: str = "data") -> list[Example]:
    """Every example of a JSONL or text file (errors name the file and line)."""
    path = Path(path)
    if not path.exists():
        raise CliError(f"{what} file {path} does not exist")
    if path.is_dir():
        raise CliError(f"{what} {path} is a directory; give a .jsonl or .txt file")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        examples = [Example(line.rstrip("\r\n"), None, n) for n, line in enumerate(_lines(path), start=1)
                    if line.strip()]
    elif suffix in JSONL_SUFFIXES:
        examples = _read_jsonl(path, text_field, id_field)
    else:
        raise CliError(f"{what} file {path}: unknown format {suffix or '(no suffix)'!r}; use .jsonl (one JSON "
                       "object per line) or .txt (one example per line)")
    if not examples:
        raise CliError(f"{what} file {path} holds no examples")
    return examples


def _lines(path: Path) -> Iterable[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as err:
        raise CliError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_jsonl(path: Path, text_field: str, id_field: str) -> list[Example]:
    examples: list[Example] = []
    first_with_id: int | None = None
    first_without_id: int | None = None
    seen: dict[str, int] = {}
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise CliError(f"{path} line {n} is not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise CliError(f"{path} line {n} is a JSON {type(record).__name__}, not an object")
        if text_field not in record:
            fields = ", ".join(sorted(map(str, record))[:8]) or "none"
            raise CliError(f"{path} line {n} has no {text_field!r} field (it has: {fields}); choose the text with "
                           "--text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise CliError(f"{path} line {n}: {text_field!r} is a {type(text).__name__}, not a string")
        ident = record.get(id_field)
        if ident is None:
            first_without_id = first_without_id or n
        else:
            if not isinstance(ident, (str, int)) or isinstance(ident, bool):
                raise CliError(f"{path} line {n}: id {ident!r} must be a string or an integer")
            ident = str(ident)
            first_with_id = first_with_id or n
            if ident in seen:
                raise CliError(f"{path}: id {ident!r} appears on lines {seen[ident]} and {n}; ids must be unique")
            seen[ident] = n
        if first_with_id and first_without_id:
            raise CliError(f"{path}: line {first_with_id} has an {id_field!r} field but line {first_without_id} has "
                           "none; give every record an id, or none (ids are then content hashes)")
        examples.append(Example(text, ident, n))
    return examples


def content_id(tokens: Sequence[int]) -> str:
    """The library's content hash of an example's (unpadded) token ids."""
    from ..capture.context import content_hash

    return content_hash(np.asarray(tokens, dtype=np.int64))


def token_ids(examples: Sequence[Example], tokenizer: Any, max_length: int | None, truncate: bool, *,
              source: Path | str = "data") -> tuple[list[np.ndarray], list[str], int]:
    """Tokenize ``examples``: ``(token arrays [T_i] int32, ids, number truncated)``.

    Examples longer than ``max_length`` tokens are an error naming the first one (and counting the
    others) unless ``truncate``; an example without any token is an error.
    """
    tokens: list[np.ndarray] = []
    for start in range(0, len(examples), TOKENIZE_CHUNK):
        chunk = [e.text for e in examples[start:start + TOKENIZE_CHUNK]]
        tokens += [np.asarray(t, dtype=np.int32) for t in tokenizer(chunk, add_special_tokens=True)["input_ids"]]
    empty = [e for e, t in zip(examples, tokens) if not len(t)]
    if empty:
        raise CliError(f"{source} line {empty[0].line} has no tokens (empty text)"
                       + (f"; {len(empty) - 1} more lines too" if len(empty) > 1 else ""))
    truncated = 0
    if max_length is not None:
        long = [(e, len(t)) for e, t in zip(examples, tokens) if len(t) > max_length]
        if long and not truncate:
            first, length = long[0]
            more = f" ({len(long) - 1} more examples are too long)" if len(long) > 1 else ""
            raise CliError(f"{source} line {first.line}{_id_note(first)} has {length} tokens, more than --max-length "
                           f"{max_length}{more}; pass --truncate to cut them, or a larger --max-length")
        truncated = len(long)
        tokens = [t[:max_length] for t in tokens]
    counts: dict[str, int] = {}
    ids = []
    for example, toks in zip(examples, tokens):
        if example.id is not None:
            ids.append(example.id)
            continue
        digest = content_id(toks)
        repeat = counts.get(digest, 0)
        counts[digest] = repeat + 1
        ids.append(digest if repeat == 0 else f"{digest}#{repeat}")
    return tokens, ids, truncated


def _id_note(example: Example) -> str:
    return f" (id {example.id!r})" if example.id is not None else ""


class Batches:
    """Right-padded batches ``{"input_ids": [B, T], "attention_mask": [B, T], "id": [B ids]}`` in file order,
    padded one at a time as they are iterated (``len()`` is the number of batches, for progress bars)."""

    def __init__(self, tokens: Sequence[np.ndarray], ids: Sequence[str], batch_size: int, pad_id: int) -> None:
        self.tokens, self.ids, self.batch_size, self.pad_id = tokens, ids, batch_size, pad_id

    def __len__(self) -> int:
        return -(-len(self.tokens) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self.tokens), self.batch_size):
            rows = self.tokens[start:start + self.batch_size]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, T]
            mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
            for i, row in enumerate(rows):
                input_ids[i, :len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
                mask[i, :len(row)] = 1
            yield {"input_ids": input_ids, "attention_mask": mask, "id": list(self.ids[start:start + self.batch_size])}


def make_batches(tokens: Sequence[Sequence[int] | np.ndarray], ids: Sequence[str], batch_size: int,
                 pad_id: int) -> Batches:
    """:class:`Batches` of ``tokens`` (one token sequence per example) with their ids."""
    return Batches(tokens, ids, batch_size, pad_id)


def text_index(path: Path, text_field: str, id_field: str, tokenizer: Any | None, max_length: int | None, *,
               what: str = "data") -> dict[str, str]:
    """``{id: text}`` of a dataset, ids computed as :func:`token_ids` does (content hashes need ``tokenizer``;
    examples longer than ``max_length`` are hashed truncated, as ``--truncate`` stored them)."""
    examples = read_examples(path, text_field, id_field, what=what)
    if all(e.id is not None for e in examples):
        return {e.id: e.text for e in examples}  # type: ignore[misc]
    if tokenizer is None:
        raise CliError(f"{path} has no {id_field!r} field, so its ids are content hashes of tokens: pass --model "
                       "MODEL_DIR to tokenize it")
    _, ids, _ = token_ids(examples, tokenizer, max_length, truncate=True, source=path)
    return dict(zip(ids, (e.text for e in examples)))
