"""``gradtrace.data.load``: a source of training or query examples -> a :class:`TokenizedDataset`.

One pass over the source, chunk by chunk: every record is checked (one format per source, fields present
and typed, ids all-or-none and unique), tokenized with its loss mask, truncated and identified. Every
problem is found here, before collection starts, so a bad record never leaves a half-written store.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..options.base import option_object
from ..options.data import BatchOptions, ReadOptions
from . import sources
from .chat import check_chat_template
from .dataset import DataSummary, TokenizedDataset
from .errors import DataError
from .files import warn_if_changed
from .formats import Fields, detect, has_fields, loss_targets, missing_fields_error, preference_error, validate
from .generate import Generate, generate_chunk, prompt_of
from .ids import ContentIds, content_hash
from .preference import is_preference, load_preference
from .sources import Source, open_source
from .tokenize import TokenChunk, tokenize_chunk

__all__ = ["dataset_texts", "load"]

SHOWN_IDS = 5


def load(source: Any, tokenizer: Any, *, fields: Fields | None = None, read_options: ReadOptions | None = None,
         batch_options: BatchOptions | None = None, generate: Generate | None = None,
         what: str = "data") -> TokenizedDataset:
    """Read, check, tokenize and identify a dataset; iterate the result for :func:`gradtrace.collect` batches.

    Args:
        source: a ``.jsonl``/``.json``/``.parquet``/``.csv``/``.txt`` file, a directory written by
            ``datasets``' ``save_to_disk`` (``Dataset`` or ``DatasetDict``), a ``datasets.Dataset`` /
            ``DatasetDict``, or a list of dicts.
        tokenizer: a Hugging Face tokenizer (with a chat template for conversational data).
        fields: which field (column) of a record holds what (:class:`gradtrace.options.data.Fields`; default
            ``text``, ``prompt``, ``completion``, ``messages``, ``id``).
        read_options: the split and format read, the tokens in the loss, the longest example, EOS, whether texts
            are kept (:class:`gradtrace.options.data.ReadOptions`; default: format and loss detected, no limit).
        batch_options: examples per batch and the padding token (:class:`gradtrace.options.data.BatchOptions`;
            default 8 per batch, padded with the tokenizer's pad token, else EOS).
        generate: a :class:`Generate` (the model and decoding settings) to answer each record's prompt with the
            model and make the answer the example's loss (``.answers`` holds the decoded answers).
        what: what the data is, in error messages (``"data"``, ``"queries"``).

    Returns:
        A :class:`TokenizedDataset`: ``.ids``, ``.summary.line()``, and batches with ``input_ids``,
        ``attention_mask``, ``labels`` (``-100`` outside the loss) and ``id``.

    Raises:
        DataError: a source or record that cannot be read as asked (named with its line or row), an example too long
            for ``max_length`` without ``truncate``, ``add_eos`` with ``generate`` or with data other than text.
        TypeError: an option argument that is not the option object it names.
    """
    fields = option_object(fields, Fields, "fields")
    read = option_object(read_options, ReadOptions, "read_options")
    batching = option_object(batch_options, BatchOptions, "batch_options")
    if read.add_eos and generate is not None:
        raise DataError("--eos (add_eos) applies to text examples; --generate makes prompt/answer examples: drop --eos")
    src = open_source(source, split=read.split, text_field=fields.text, what=what, chunk_rows=sources.CHUNK_ROWS)
    state = _State(src, fields, "text" if src.text_only else read.format)
    if generate is not None:
        state.format, state.targets = "prompt-completion", "completion"
    for chunk in src.chunks:
        wheres = [src.where(location) for location in chunk.locations]
        if generate is not None:
            for record, location, where in zip(chunk.records, chunk.locations, wheres):
                state.check_id(record, location, where)
            tokens, answers = generate_chunk(chunk.records, wheres, tokenizer, fields, generate)
            state.answers += answers
            state.add(tokens, chunk.records, wheres, read, answers)
            continue
        state.check(chunk.records, chunk.locations, wheres)
        if state.targets is None:
            state.targets = loss_targets(state.format, read.loss_on, state.conversational)  # type: ignore[arg-type]
            if state.conversational:
                check_chat_template(tokenizer, f"{what} {src.name}")
            if read.add_eos and state.format != "text":
                raise DataError(f"{what} file {src.name} is {state.format} data: --eos (add_eos) applies to text "
                                "examples only (completions always end with EOS; chat templates end the turns); "
                                "drop it")
        tokens = tokenize_chunk(chunk.records, wheres, tokenizer, state.format, state.conversational, state.targets,
                                fields, read.add_eos, read.max_length)  # a text far longer is cut before tokenizing
        state.add(tokens, chunk.records, wheres, read)
    state.eos_added = read.add_eos
    return state.finish(tokenizer, read, batching, what)


@dataclass
class _State:
    """What one pass over a source has gathered so far."""

    source: Source
    fields: Fields
    requested: str
    format: str | None = None
    conversational: bool = False
    targets: str | None = None
    first_where: str = ""
    id_rule: tuple[int, bool] | None = None  # (location, has an id) of the first record
    seen_ids: dict[str, int] = field(default_factory=dict)
    content_ids: ContentIds = field(default_factory=ContentIds)
    ids: list[str] = field(default_factory=list)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    too_long: list[tuple[str, str | None, int, bool]] = field(default_factory=list)  # needed: a lower bound if True
    prompt_truncated: int = 0
    cut: int = 0
    eos_added: bool = False

    def check(self, records: list[dict[str, Any]], locations: list[int], wheres: list[str]) -> None:
        """One format per source (the first record's), each record valid; ids all-or-none and unique."""
        for record, location, where in zip(records, locations, wheres):
            if self.requested == "preference":
                raise preference_error(f"{self.source.name} (--format preference)", self.fields)
            if self.requested == "auto":
                fmt = detect(record, self.fields)
                if fmt is None:
                    raise missing_fields_error(record, self.fields, where, "auto")
                if fmt == "preference":
                    raise preference_error(where, self.fields)
            else:
                fmt = self.requested
                if not has_fields(record, fmt, self.fields):  # type: ignore[arg-type]
                    raise missing_fields_error(record, self.fields, where, fmt)
            conversational = validate(record, fmt, self.fields, where)  # type: ignore[arg-type]
            if self.format is None:
                self.format, self.conversational, self.first_where = fmt, conversational, where
            elif fmt != self.format:
                raise DataError(f"{where} is {fmt} data but {self.first_where} is {self.format}: one source holds one "
                                "format; split it, or choose --format and the field names")
            elif conversational != self.conversational:
                kinds = {True: "message lists", False: "strings"}
                raise DataError(f"{where} has {kinds[conversational]} for prompt/completion but {self.first_where} "
                                f"has {kinds[self.conversational]}: mixed formats in one source; split it")
            self.check_id(record, location, where)

    def check_id(self, record: dict[str, Any], location: int, where: str) -> None:
        ident = record.get(self.fields.id)
        has = ident is not None
        if self.id_rule is None:
            self.id_rule = (location, has)
        elif self.id_rule[1] != has:
            with_id, without = (self.id_rule[0], location) if self.id_rule[1] else (location, self.id_rule[0])
            unit = self.source.unit
            raise DataError(f"{self.source.name}: {unit} {with_id} has an {self.fields.id!r} field but {unit} "
                            f"{without} has none; give every record an id, or none (ids are then content hashes)")
        if not has:
            return
        if not isinstance(ident, (str, int)) or isinstance(ident, bool):
            raise DataError(f"{where}: id {ident!r} must be a string or an integer")
        key = str(ident)
        if key in self.seen_ids:
            raise DataError(f"{self.source.name}: id {key!r} appears on {self.source.unit}s {self.seen_ids[key]} and "
                            f"{location}; ids must be unique")
        self.seen_ids[key] = location

    def add(self, tokens: TokenChunk, records: list[dict[str, Any]], wheres: list[str], read: ReadOptions,
            answers: list[str] | None = None) -> None:
        """Truncate and identify a tokenized chunk, and keep it."""
        self.empty += [w for w, n in zip(wheres, tokens.lengths) if n == 0]
        user_ids = [None if r.get(self.fields.id) is None else str(r[self.fields.id]) for r in records]
        if read.max_length is not None:
            partial = tokens.partial if tokens.partial is not None else np.zeros(len(records), dtype=bool)
            tokens, prompt_cut, too_long, needed = _truncate(tokens, read.max_length, read.truncate)
            self.prompt_truncated += int(prompt_cut.sum())
            self.cut += int(too_long.sum()) if read.truncate else 0
            self.too_long += [(wheres[i], user_ids[i], int(needed[i]), bool(partial[i]))
                              for i in np.flatnonzero(too_long)]
        offsets = tokens.offsets
        hashed = [i for i, ident in enumerate(user_ids) if ident is None]
        numbered = iter(self.content_ids.number(content_hash(tokens.tokens[offsets[i]:offsets[i + 1]]) for i in hashed))
        self.ids += [next(numbered) if ident is None else ident for ident in user_ids]
        self.parts.append((tokens.tokens.astype(np.int32), tokens.loss, tokens.lengths))
        if read.keep_text and answers is not None:
            self.texts += [_prompt_text(prompt_of(r, self.fields, w)) + a for r, w, a in zip(records, wheres, answers)]
        elif read.keep_text:
            self.texts += [display_text(r, self.format, self.fields) for r in records]

    def finish(self, tokenizer: Any, read: ReadOptions, batching: BatchOptions, what: str) -> TokenizedDataset:
        if not self.ids:
            raise DataError(f"{what} file {self.source.name} holds no examples")
        if self.empty:
            more = f"; {len(self.empty) - 1} more {self.source.unit}s too" if len(self.empty) > 1 else ""
            raise DataError(f"{self.empty[0]} has no tokens (empty text){more}")
        if self.too_long and not read.truncate:
            raise _too_long_error(self.too_long, self.format, read.max_length)
        tokens = np.concatenate([p[0] for p in self.parts])
        loss = np.concatenate([p[1] for p in self.parts])
        lengths = np.concatenate([p[2] for p in self.parts])
        targets = loss.copy()
        targets[np.concatenate([[0], np.cumsum(lengths)[:-1]])[lengths > 0]] = False  # a first token is never a target
        summary = DataSummary(self.source.name, len(self.ids), self.format, self.conversational, self.targets or "all",
                              int(targets.sum()), len(tokens), self.prompt_truncated, self.cut,
                              self.fields.id if self.id_rule and self.id_rule[1] else None, bool(self.answers),
                              self.eos_added)
        if batching.pad_id is None:
            pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
            batching = replace(batching, pad_id=pad_id)
        return TokenizedDataset(tokens, loss, lengths, self.ids, summary, batch_options=batching,
                                texts=self.texts or None, answers=self.answers or None)


def _truncate(chunk: TokenChunk, max_length: int, keep_long: bool
              ) -> tuple[TokenChunk, np.ndarray, np.ndarray, np.ndarray]:
    """Fit every example in ``max_length`` tokens, vectorized over the chunk.

    The prompt is cut from the left, up to one token before the part truncation keeps (``keep_from``), so the
    first completion token still has a token to be predicted from. Returns the truncated chunk, ``[E]`` bool
    "prompt was cut", ``[E]`` bool "still too long" (cut on the right when ``keep_long``, else left whole for
    the error), and ``[E]`` the tokens each example needs at least.
    """
    lengths = chunk.lengths
    protect = np.maximum(chunk.keep_from - 1, 0)
    left = np.clip(lengths - max_length, 0, protect)  # [E] tokens cut from the left
    needed = lengths - protect
    too_long = lengths - left > max_length
    if not keep_long:
        left = np.where(too_long, 0, left)
    stop = np.where(too_long & keep_long, left + max_length, lengths)  # [E] exclusive, local
    example = chunk.example_of_token()
    local = np.arange(len(chunk.tokens)) - np.repeat(chunk.offsets[:-1], lengths)
    keep = (local >= left[example]) & (local < stop[example])
    out = TokenChunk(chunk.tokens[keep], chunk.loss[keep], stop - left, np.maximum(chunk.keep_from - left, 0))
    return out, left > 0, too_long, needed


def _too_long_error(too_long: list[tuple[str, str | None, int, bool]], fmt: str, max_length: int | None
                    ) -> DataError:
    where, ident, needed, partial = too_long[0]
    count = f"more than {max_length}" if partial else f"{needed}"  # cut before tokenization: needed is a lower bound
    note = f" (id {ident!r})" if ident is not None else ""
    more = (f" ({len(too_long) - 1} more example{'s are' if len(too_long) > 2 else ' is'} too long"
            if len(too_long) > 1 else "")
    if more:
        shown = [i if i is not None else w for w, i, _, _ in too_long[1:1 + SHOWN_IDS]]
        more += f": {', '.join(shown)}{', ...' if len(too_long) > 1 + SHOWN_IDS else ''})"
    if fmt == "text":
        size = f"more tokens than --max-length {max_length}" if partial else \
            f"{needed} tokens, more than --max-length {max_length}"
        return DataError(f"{where}{note} has {size}{more}; pass "
                         "--truncate to cut them, or a larger --max-length")
    part = "completion" if fmt == "prompt-completion" else "conversation from its first assistant turn"
    return DataError(f"{where}{note}: its {part} alone needs {count} tokens (with one token of context), more than "
                     f"--max-length {max_length}{more}; pass --truncate to cut them on the right, or a larger "
                     "--max-length")


def _prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant: "


def display_text(record: dict[str, Any], fmt: str, fields: Fields) -> str:
    """A record's text for display: the text, prompt + completion, or the conversation as ``role: content``."""
    if fmt == "text":
        return record[fields.text]
    if fmt == "messages":
        return "\n".join(f"{m['role']}: {m['content']}" for m in record[fields.messages])
    prompt, completion = record[fields.prompt], record[fields.completion]
    if isinstance(prompt, str):
        return prompt + completion
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt + completion)


def texts(source: Any, tokenizer: Any | None = None, *, fields: Fields | None = None,
          read_options: ReadOptions | None = None, prompts: bool = False, what: str = "data") -> dict[str, str]:
    """``{id: text}`` of a dataset for display (``text``, ``prompt + completion`` or the conversation), the ids
    computed as :func:`load` computes them.

    Args:
        source, fields, what: as :func:`load` takes them.
        tokenizer: the tokenizer content-hash ids need (None: the records must have ids).
        read_options: as :func:`load` takes them; ``truncate`` and ``keep_text`` are set here (an example longer
            than ``max_length`` is hashed as ``truncate=True`` stored it).
        prompts: the source holds query prompts answered with ``generate=`` (their text is the prompt; they need
            ids).

    Raises:
        DataError: as :func:`load`, or records without ids and no ``tokenizer`` (or ``prompts``) to hash them.
    """
    fields = option_object(fields, Fields, "fields")
    read = option_object(read_options, ReadOptions, "read_options")
    if tokenizer is not None and not prompts and (read.format == "preference" or (
            read.format == "auto" and is_preference(source, fields, read.split, what))):
        pairs = load_preference(source, tokenizer, fields=fields, read_options=replace(
            read, format="auto", truncate=True, keep_text=True), what=what)
        return dict(zip(pairs.ids, pairs.texts or []))
    if tokenizer is not None and not prompts:
        data = load(source, tokenizer, fields=fields, read_options=replace(read, truncate=True, keep_text=True),
                    what=what)
        return dict(zip(data.ids, data.texts or []))
    src = open_source(source, split=read.split, text_field=fields.text, what=what, chunk_rows=sources.CHUNK_ROWS)
    state = _State(src, fields, "text" if src.text_only else read.format)
    out: dict[str, str] = {}
    for chunk in src.chunks:
        wheres = [src.where(location) for location in chunk.locations]
        if prompts:
            for record, location, where in zip(chunk.records, chunk.locations, wheres):
                state.check_id(record, location, where)
        else:
            state.check(chunk.records, chunk.locations, wheres)
        if state.id_rule is not None and not state.id_rule[1]:
            hashed = "prompt + answer tokens" if prompts else "tokens"
            raise DataError(f"{src.name} has no {fields.id!r} field, so its ids are content hashes of {hashed}: "
                            + ("give the prompts ids to show them" if prompts else
                               "pass --model MODEL_DIR to tokenize it"))
        if prompts:
            out.update((str(r[fields.id]), _prompt_text(prompt_of(r, fields, w)))
                       for r, w in zip(chunk.records, wheres))
        else:
            out.update((str(r[fields.id]), display_text(r, state.format or "text", fields)) for r in chunk.records)
    if not out:
        raise DataError(f"{what} file {src.name} holds no examples")
    return out


def dataset_texts(path: Path, tokenizer: Any | None, recorded: dict[str, Any], *, text_field: str, id_field: str,
                  what: str) -> dict[str, str]:
    """``{id: text}`` of a dataset, read with the data options ``recorded`` when it was collected or scored
    (the commands' option names: ``data_format``, ``split``, the prompt/completion/messages fields, ``eos``,
    ``max_length``, ``generate``; the commands' defaults where absent), ``text_field``/``id_field`` as given. A file
    that no longer holds the bytes ``recorded`` fingerprints is read with a
    :class:`gradtrace.data.files.DataChangedWarning` naming it."""
    warn_if_changed(path, recorded, what)
    names = {"prompt": "prompt_field", "completion": "completion_field", "messages": "messages_field",
             "chosen": "chosen_field", "rejected": "rejected_field"}
    fields = Fields(text=text_field, id=id_field, **{key: recorded[name] for key, name in names.items()
                                                     if recorded.get(name)})
    read = ReadOptions(format=recorded.get("data_format") or "auto", split=recorded.get("split"),
                       max_length=recorded.get("max_length"), add_eos=bool(recorded.get("eos")))
    return texts(path, tokenizer, fields=fields, read_options=read, prompts=bool(recorded.get("generate")),
                 what=what)
