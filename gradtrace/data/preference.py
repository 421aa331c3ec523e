"""Preference pairs (TRL's preference format) -> batches of pairs for the DPO loss.

``gradtrace.data.load_preference(source, tokenizer)`` reads records with ``chosen`` and ``rejected`` fields:

* *standard*: ``prompt``, ``chosen`` and ``rejected`` strings;
* *conversational*: the three are lists of ``{role, content}`` messages (the prompt's turns, then the chosen or
  rejected assistant turn);
* *implicit prompt*: no ``prompt`` field -- ``chosen`` and ``rejected`` hold the whole text or conversation, and
  the prompt is their common beginning (``trl.data_utils.extract_prompt``'s rule: the longest common prefix of
  characters or of messages).

Each side is tokenized the way TRL's ``DPOTrainer`` tokenizes it: standard text gets the EOS token appended to the
completion (unless it ends with it), ``tokenizer(prompt)`` and ``tokenizer(prompt + completion)`` are tokenized and
the completion starts where both sides' tokens leave the prompt's (the shorter of the two common prefixes); a
conversation is rendered by the chat template (the prompt with the generation prompt). The completion tokens are
the side's labels; the prompt's are ``-100``.

A pair is one example: its id is the record's id, or a content hash of its chosen tokens followed by its rejected
tokens -- the hash the capture gives a pair whose rows it joins, so a store written inside ``DPOTrainer`` with
``ids=None`` and one collected afterwards share ids. The reference model's summed log-probabilities of each side
come from the data (TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns) or are computed once by
:meth:`PreferenceDataset.with_reference`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..loss.preference import DPO, REFERENCE_KEYS, reference_logps
from ..options.base import option_object
from ..options.data import BatchOptions, Fields, ReadOptions
from .chat import chat_tokens, check_chat_template, common_prefix
from .dataset import padded_rows, target_counts
from .errors import DataError
from .formats import detect
from .ids import ContentIds, content_hash
from .sources import CHUNK_ROWS, open_source
from .tokenize import flat_tokens

__all__ = ["PreferenceDataset", "PreferenceSummary", "extract_prompt", "is_preference", "load_preference"]

SIDES = ("chosen", "rejected")


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple[str | list, str | list, str | list]:
    """``(prompt, chosen, rejected)`` of an implicit-prompt pair: the prompt is the longest common beginning of the
    two (characters of strings, messages of conversations), as ``trl.data_utils.extract_prompt`` cuts it (also
    its quirks: a space just before the divergence goes to the completions; one side a prefix of the other keeps
    the last shared item in the completions)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


@dataclass(frozen=True)
class PreferenceSummary:
    """What was read, for the one-line summary printed before collection."""

    source: str
    examples: int
    conversational: bool
    implicit_prompt: bool
    loss_tokens: int
    total_tokens: int
    cut: int
    id_field: str | None
    reference: str  # "data" (TRL's columns), "model" (with_reference), "none" (not yet)

    @property
    def format(self) -> str:
        return "preference"

    def line(self) -> str:
        """``prefs.jsonl: 6 pairs, preference (conversational), loss on chosen and rejected completions: ...``."""
        kind = "preference" + (" (conversational)" if self.conversational else "")
        kind += " (implicit prompt)" if self.implicit_prompt else ""
        share = self.loss_tokens / max(self.total_tokens, 1)
        pairs = f"{self.examples:,} pair{'' if self.examples == 1 else 's'}"
        reference = {"data": "reference log-probs from the data", "model": "reference log-probs from the reference "
                     "model", "none": "no reference log-probs yet"}[self.reference]
        out = (f"{self.source}: {pairs}, {kind}, loss on the chosen and rejected completions: {self.loss_tokens:,} of "
               f"{self.total_tokens:,} tokens ({share:.1%}), {reference}")
        if self.cut:
            out += f", {self.cut:,} sides cut to --max-length (--truncate)"
        return out + (f", ids from {self.id_field!r}" if self.id_field else ", content-hash ids")


class PreferenceDataset:
    """Tokenized preference pairs; iterating yields batches of pairs for :class:`gradtrace.loss.preference.DPOLoss`.

    Each batch of ``P`` pairs holds ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels`` (``-100``
    outside the completion), the same three ``rejected_*`` tensors (``[P, T]``, right-padded), ``id`` (``P``
    strings) and, once known, ``ref_chosen_logps`` / ``ref_rejected_logps`` (``[P]`` float32).

    Attributes:
        ids: one id per pair, in order.
        summary: a :class:`PreferenceSummary` (``summary.line()``).
        reference: ``[P, 2]`` float32 reference log-probabilities (chosen, rejected) or None.
        texts: each pair's display text (``ReadOptions(keep_text=True)``), else None.
    """

    def __init__(self, tokens: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], ids: list[str],
                 summary: PreferenceSummary, *, batch_options: BatchOptions, reference: np.ndarray | None = None,
                 texts: list[str] | None = None) -> None:
        """``tokens``: for ``"chosen"`` and ``"rejected"``, ``(flat tokens [N] int32, flat in-loss [N] bool, lengths
        [P])``; ``ids``: one per pair; ``reference``: ``[P, 2]`` or None."""
        if batch_options.pad_id is None:
            raise ValueError("PreferenceDataset needs batch_options.pad_id: the padding token of its batches")
        self.tokens = tokens
        self.offsets = {side: np.concatenate([[0], np.cumsum(t[2])]).astype(np.int64) for side, t in tokens.items()}
        self.ids = ids
        self.summary = summary
        self.batch_options = batch_options
        self.reference = reference
        self.texts = texts
        self.answers = None

    def __len__(self) -> int:
        """Number of batches (for progress bars)."""
        return -(-len(self.ids) // self.batch_options.batch_size)

    @property
    def num_examples(self) -> int:
        return len(self.ids)

    def target_counts(self) -> np.ndarray:
        """``[P]`` completion tokens each pair's loss predicts (its two sides' label tokens but a side's first token,
        which nothing predicts)."""
        return sum(target_counts(self.tokens[side][1], self.tokens[side][2], self.offsets[side]) for side in SIDES)

    def no_target_ids(self) -> list[str]:
        """Ids of the pairs without a completion token (their gradient is zero)."""
        return [self.ids[i] for i in np.flatnonzero(self.target_counts() == 0).tolist()]

    def _side(self, side: str, pairs: np.ndarray) -> dict[str, torch.Tensor]:
        flat, loss, lengths = self.tokens[side]
        input_ids, valid, labels = padded_rows(flat, loss, lengths, self.offsets[side], pairs,
                                               self.batch_options.pad_id)
        return {f"{side}_input_ids": torch.from_numpy(input_ids),
                f"{side}_attention_mask": torch.from_numpy(valid.astype(np.int64)),
                f"{side}_labels": torch.from_numpy(labels)}

    def rows(self, pairs: np.ndarray) -> dict[str, Any]:
        """The pairs of index array ``pairs`` ``[P]``, in that order, as one batch."""
        batch: dict[str, Any] = {**self._side("chosen", pairs), **self._side("rejected", pairs)}
        if self.reference is not None:
            reference = torch.from_numpy(self.reference[pairs])
            batch[REFERENCE_KEYS[0]], batch[REFERENCE_KEYS[1]] = reference[:, 0], reference[:, 1]
        batch["id"] = [self.ids[i] for i in pairs.tolist()]
        return batch

    def batches(self, order: Sequence[int] | np.ndarray | None = None) -> Iterator[dict[str, Any]]:
        """Batches of ``batch_options.batch_size`` pairs taken in ``order`` (default: file order)."""
        pairs = np.arange(len(self.ids)) if order is None else np.asarray(order, dtype=np.int64)
        if pairs.ndim != 1 or (len(pairs) and not (pairs.min() >= 0 and pairs.max() < len(self.ids))):
            raise IndexError(f"order must be a 1-d array of pair indices in [0, {len(self.ids)})")
        size = self.batch_options.batch_size
        for start in range(0, len(pairs), size):
            yield self.rows(pairs[start:start + size])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.batches()

    def with_reference(self, model: torch.nn.Module, settings: DPO | None = None, *,
                       batch_size: int | None = None) -> PreferenceDataset:
        """This dataset with the reference log-probabilities of ``model`` (the run's reference model, or the policy
        before DPO), computed once, without gradient, on the model's device (``settings.ld_alpha`` applies as in the
        loss; ``batch_size``: pairs per forward call, default the dataset's). Refused when the data has them."""
        if self.summary.reference == "data":
            raise ValueError("the preference data already holds the reference log-probabilities (ref_chosen_logps / "
                             "ref_rejected_logps): they are used as they are; give no reference model")
        size = batch_size or self.batch_options.batch_size
        out = np.zeros((len(self.ids), 2), dtype=np.float32)
        bare = PreferenceDataset(self.tokens, self.ids, self.summary,
                                 batch_options=replace(self.batch_options, batch_size=size))
        start = 0
        for batch in bare:
            chosen, rejected = reference_logps(model, batch, settings)
            stop = start + len(batch["id"])
            out[start:stop, 0], out[start:stop, 1] = chosen.float().cpu().numpy(), rejected.float().cpu().numpy()
            start = stop
        if not np.isfinite(out).all():
            bad = [self.ids[i] for i in np.flatnonzero(~np.isfinite(out).all(1))[:3]]
            raise ValueError(f"the reference model gives NaN/inf log-probabilities for pairs {', '.join(bad)}: check "
                             "its weights and dtype")
        return PreferenceDataset(self.tokens, self.ids, replace(self.summary, reference="model"),
                                 batch_options=self.batch_options, reference=out, texts=self.texts)

    def __repr__(self) -> str:
        return f"PreferenceDataset({self.summary.line()})"


def load_preference(source: Any, tokenizer: Any, *, fields: Fields | None = None,
                    read_options: ReadOptions | None = None, batch_options: BatchOptions | None = None,
                    what: str = "data") -> PreferenceDataset:
    """Read, check and tokenize preference pairs (see the module docstring); iterate the result for batches.

    Args:
        source: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a ``save_to_disk`` directory, a ``datasets``
            dataset or a list of dicts, whose records have ``chosen`` and ``rejected`` fields (and ``prompt``, unless
            the prompt is implicit; TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` are read when present).
        tokenizer: a Hugging Face tokenizer (with a chat template for conversational pairs).
        fields: the field names (:class:`gradtrace.options.data.Fields`: ``prompt``, ``chosen``, ``rejected``, ``id``).
        read_options: ``split``, ``max_length`` (a side longer than it is an error, or with ``truncate`` keeps its
            first ``max_length`` tokens: TRL's default ``truncation_mode="keep_start"``), ``keep_text``. ``format``
            must be ``"auto"`` or ``"preference"``; ``loss_on`` ``"auto"`` (the completions) or ``"completion"``.
        batch_options: pairs per batch and the padding token.
        what: what the data is, in error messages.

    Raises:
        DataError: a record that is not a preference pair (named with its line or row), mixed standard and
            conversational pairs, a side without completion tokens, a side too long, ids not unique.
    """
    fields = option_object(fields, Fields, "fields")
    read = option_object(read_options, ReadOptions, "read_options")
    batching = option_object(batch_options, BatchOptions, "batch_options")
    if read.format not in ("auto", "preference"):
        raise DataError(f"load_preference reads preference pairs; format {read.format!r} is read by "
                        "gradtrace.data.load")
    if read.loss_on not in ("auto", "completion"):
        raise DataError(f"--loss-on {read.loss_on}: a preference pair's loss is on its two completions (TRL's DPO "
                        "loss); use auto")
    if read.add_eos:
        raise DataError("--eos (add_eos) applies to text examples; preference completions always end with EOS")
    src = open_source(source, split=read.split, text_field=fields.text, what=what, chunk_rows=CHUNK_ROWS)
    reader = _Reader(src.name, src.unit, fields, tokenizer, read)
    for chunk in src.chunks:
        reader.add(chunk.records, chunk.locations, [src.where(loc) for loc in chunk.locations])
    return reader.finish(batching, what)


def is_preference(source: Any, fields: Fields | None = None, split: str | None = None, what: str = "data") -> bool:
    """Whether a source's first record is a preference pair (has the ``chosen`` and ``rejected`` fields)."""
    fields = option_object(fields, Fields, "fields")
    src = open_source(source, split=split, text_field=fields.text, what=what, chunk_rows=CHUNK_ROWS)
    for chunk in src.chunks:
        return bool(chunk.records) and detect(chunk.records[0], fields) == "preference"
    return False


class _Reader:
    """One pass over a preference source: records checked, tokenized and identified chunk by chunk."""

    def __init__(self, name: str, unit: str, fields: Fields, tokenizer: Any, read: ReadOptions) -> None:
        self.name, self.unit, self.fields, self.tokenizer, self.read = name, unit, fields, tokenizer, read
        self.conversational: bool | None = None
        self.implicit: bool | None = None
        self.first_where = ""
        self.has_ids: bool | None = None
        self.has_reference: bool | None = None
        self.seen: dict[str, int] = {}
        self.content_ids = ContentIds()
        self.ids: list[str] = []
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {side: [] for side in SIDES}
        self.reference: list[np.ndarray] = []
        self.texts: list[str] = []
        self.cut = 0

    def _kind(self, record: dict[str, Any], where: str) -> tuple[bool, bool]:
        """``(conversational, implicit prompt)`` of a record, checked against the first record's."""
        f = self.fields
        if f.chosen not in record or f.rejected not in record:
            found = ", ".join(sorted(map(str, record))[:8]) or "none"
            raise DataError(f"{where} is not a preference pair: it needs {f.chosen!r} and {f.rejected!r} fields (it "
                            f"has: {found}); name them with --chosen-field/--rejected-field")
        chosen, rejected, prompt = record[f.chosen], record[f.rejected], record.get(f.prompt)
        conversational = isinstance(chosen, list)
        for name, value in ((f.chosen, chosen), (f.rejected, rejected)) + (((f.prompt, prompt),) if prompt is not None
                                                                           else ()):
            _check_value(value, name, conversational, where)
        implicit = prompt is None
        if self.conversational is None:
            self.conversational, self.implicit, self.first_where = conversational, implicit, where
            if conversational:
                check_chat_template(self.tokenizer, f"preference data {self.name}")
        elif conversational != self.conversational:
            kinds = {True: "message lists", False: "strings"}
            raise DataError(f"{where} has {kinds[conversational]} but {self.first_where} has "
                            f"{kinds[self.conversational]}: mixed formats in one source; split it")
        elif implicit != self.implicit:
            raise DataError(f"{where} {'has no' if implicit else 'has a'} {f.prompt!r} field but {self.first_where} "
                            f"{'has one' if implicit else 'has none'}: give every pair a prompt, or none (the prompt "
                            "is then the common beginning of chosen and rejected)")
        return conversational, implicit

    def _identity(self, record: dict[str, Any], location: int, where: str) -> str | None:
        ident = record.get(self.fields.id)
        has = ident is not None
        if self.has_ids is None:
            self.has_ids = has
        elif self.has_ids != has:
            raise DataError(f"{where} {'has' if has else 'has no'} {self.fields.id!r} field but {self.first_where} "
                            f"{'has none' if has else 'has one'}; give every pair an id, or none (content hashes)")
        if not has:
            return None
        if not isinstance(ident, (str, int)) or isinstance(ident, bool):
            raise DataError(f"{where}: id {ident!r} must be a string or an integer")
        key = str(ident)
        if key in self.seen:
            raise DataError(f"{self.name}: id {key!r} appears on {self.unit}s {self.seen[key]} and {location}; ids "
                            "must be unique")
        self.seen[key] = location
        return key

    def _reference(self, record: dict[str, Any], where: str) -> np.ndarray | None:
        present = [key in record and record[key] is not None for key in REFERENCE_KEYS]
        has = all(present)
        if any(present) and not has:
            raise DataError(f"{where} has only one of {', '.join(REFERENCE_KEYS)}: give both, or neither")
        if self.has_reference is None:
            self.has_reference = has
        elif self.has_reference != has:
            raise DataError(f"{where} {'has' if has else 'has no'} reference log-probabilities "
                            f"({', '.join(REFERENCE_KEYS)}) but {self.first_where} "
                            f"{'has none' if has else 'has them'}; give them for every pair or for none")
        if not has:
            return None
        values = np.asarray([record[key] for key in REFERENCE_KEYS], dtype=np.float32)
        if not np.isfinite(values).all():
            raise DataError(f"{where}: {', '.join(REFERENCE_KEYS)} must be finite numbers, got {values.tolist()}")
        return values

    def add(self, records: list[dict[str, Any]], locations: list[int], wheres: list[str]) -> None:
        f = self.fields
        triples, user_ids = [], []
        for record, location, where in zip(records, locations, wheres):
            _, implicit = self._kind(record, where)
            user_ids.append(self._identity(record, location, where))
            ref = self._reference(record, where)
            if ref is not None:
                self.reference.append(ref)
            if implicit:
                prompt, chosen, rejected = extract_prompt(record[f.chosen], record[f.rejected])
            else:
                prompt, chosen, rejected = record[f.prompt], record[f.chosen], record[f.rejected]
            triples.append((prompt, chosen, rejected))
            if self.read.keep_text:
                self.texts.append(_display(prompt, chosen, rejected))
        sides = _tokenize_pairs(triples, wheres, self.tokenizer, bool(self.conversational))
        if self.read.max_length is not None:
            sides = {side: self._fit(side, *arrays, wheres, user_ids) for side, arrays in sides.items()}
        for side in SIDES:
            flat, loss, lengths = sides[side]
            empty = np.flatnonzero(~_any_per_example(loss, lengths))
            if len(empty):
                raise DataError(f"{wheres[empty[0]]}: its {side} completion has no token (after the prompt"
                                f"{' and truncation' if self.read.max_length else ''}); there is nothing to attribute")
            self.parts[side].append((flat.astype(np.int32), loss, lengths))
        hashed = [i for i, ident in enumerate(user_ids) if ident is None]
        if hashed:
            starts = {side: np.concatenate([[0], np.cumsum(sides[side][2])]) for side in SIDES}
            digests = (content_hash(np.concatenate([sides[s][0][starts[s][i]:starts[s][i + 1]] for s in SIDES]))
                       for i in hashed)
            numbered = iter(self.content_ids.number(digests))
            self.ids += [next(numbered) if ident is None else ident for ident in user_ids]
        else:
            self.ids += user_ids  # type: ignore[arg-type]

    def _fit(self, side: str, flat: np.ndarray, loss: np.ndarray, lengths: np.ndarray, wheres: list[str],
             user_ids: list[str | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A side fitted in ``max_length`` tokens: kept whole, cut to its first ``max_length`` tokens (``truncate``,
        TRL's ``keep_start``), or refused."""
        limit = self.read.max_length
        too_long = lengths > limit
        if not too_long.any():
            return flat, loss, lengths
        if not self.read.truncate:
            first = int(np.flatnonzero(too_long)[0])
            note = f" (id {user_ids[first]!r})" if user_ids[first] is not None else ""
            more = int(too_long.sum()) - 1
            raise DataError(f"{wheres[first]}{note}: its {side} side has {int(lengths[first])} tokens, more than "
                            f"--max-length {limit}{f' ({more} more sides are too long)' if more else ''}; pass "
                            "--truncate to keep their first --max-length tokens (as TRL's DPOTrainer does), or a "
                            "larger --max-length")
        self.cut += int(too_long.sum())
        local = np.arange(len(flat)) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        keep = local < limit
        return flat[keep], loss[keep], np.minimum(lengths, limit)

    def finish(self, batching: BatchOptions, what: str) -> PreferenceDataset:
        if not self.ids:
            raise DataError(f"{what} file {self.name} holds no preference pairs")
        tokens = {side: tuple(np.concatenate([p[i] for p in self.parts[side]]) for i in range(3)) for side in SIDES}
        loss_tokens = sum(int(tokens[side][1].sum()) for side in SIDES)
        total = sum(len(tokens[side][0]) for side in SIDES)
        summary = PreferenceSummary(self.name, len(self.ids), bool(self.conversational), bool(self.implicit),
                                    loss_tokens, total, self.cut, self.fields.id if self.has_ids else None,
                                    "data" if self.has_reference else "none")
        if batching.pad_id is None:
            pad_id = next((t for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0)
            batching = replace(batching, pad_id=pad_id)
        reference = np.stack(self.reference) if self.has_reference else None
        return PreferenceDataset(tokens, self.ids, summary, batch_options=batching,  # type: ignore[arg-type]
                                 reference=reference, texts=self.texts or None)


def _check_value(value: Any, name: str, conversational: bool, where: str) -> None:
    if conversational:
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise DataError(f"{where}: {name!r} must be a list of {{role, content}} messages like the chosen side, got "
                            f"{type(value).__name__}")
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise DataError(f"{where}: message {i} of {name!r} needs a string 'role' and 'content'")
    elif not isinstance(value, str):
        raise DataError(f"{where}: {name!r} must be a string like the chosen side, got {type(value).__name__}")


def _any_per_example(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[E]`` whether each example of a flat ``[N]`` bool mask has a True."""
    cumulative = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return cumulative[offsets[1:]] > cumulative[offsets[:-1]]


def _display(prompt: str | list, chosen: str | list, rejected: str | list) -> str:
    def text(part: str | list) -> str:
        return part if isinstance(part, str) else "\n".join(f"{m['role']}: {m['content']}" for m in part)

    return f"{text(prompt)}\nchosen: {text(chosen)}\nrejected: {text(rejected)}"


def _tokenize_pairs(triples: list[tuple[Any, Any, Any]], wheres: list[str], tokenizer: Any, conversational: bool
                    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``{side: (flat tokens [N], flat in-loss [N], lengths [P])}`` of the pairs, tokenized as TRL's DPOTrainer does
    (see the module docstring)."""
    if conversational:
        prompts, full = [], {side: [] for side in SIDES}
        for (prompt, chosen, rejected), where in zip(triples, wheres):
            prompts.append(chat_tokens(tokenizer, prompt, where, add_generation_prompt=True)[0])
            full["chosen"].append(chat_tokens(tokenizer, prompt + chosen, where)[0])
            full["rejected"].append(chat_tokens(tokenizer, prompt + rejected, where)[0])
    else:
        eos = tokenizer.eos_token
        if eos is None:
            raise DataError("the tokenizer has no EOS token, which preference completions end with (as TRL does); set "
                            "tokenizer.eos_token")
        texts = [p for p, _, _ in triples]
        prompts = tokenizer(texts)["input_ids"] if texts else []
        full = {side: tokenizer([p + (c if c.endswith(eos) else c + eos) for p, c in
                                 ((t[0], t[1 + i]) for t in triples)])["input_ids"]
                for i, side in enumerate(SIDES)}
    # the completion starts where either side leaves the prompt's tokens (trl: the shorter common prefix)
    starts = np.array([min(common_prefix(list(p), list(c)), common_prefix(list(p), list(r)))
                       for p, c, r in zip(prompts, full["chosen"], full["rejected"])], dtype=np.int64)
    out = {}
    for side in SIDES:
        flat, lengths = flat_tokens(full[side])
        position = np.arange(len(flat)) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        out[side] = (flat, position >= np.repeat(starts, lengths), lengths)
    return out
