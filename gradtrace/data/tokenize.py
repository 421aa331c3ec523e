"""Records of one format -> token ids and loss masks, the way TRL's ``SFTTrainer`` prepares them.

* text: ``tokenizer(text)`` (special tokens added); every token is in the loss. EOS is appended only when
  asked (``add_eos``: the EOS token's text added unless the text ends with it, as TRL's ``SFTTrainer`` does
  for language modelling); by default it is not, which keeps the content-hash ids of existing stores.
* prompt + completion strings: the EOS token is appended to the completion unless it ends with it,
  ``tokenizer(prompt)`` and ``tokenizer(prompt + completion)`` are tokenized, and the completion starts
  where the two diverge (``trl.data_utils.common_prefix_length``): the prompt's labels are ignored.
* conversational prompt + completion: the prompt rendered with the generation prompt, the whole
  conversation rendered, the completion starts where they diverge (no EOS appended: the template ends turns).
* messages: the conversation rendered; the loss is on the assistant's tokens (see :mod:`.chat`).

Each chunk of records becomes a :class:`TokenChunk`: flat arrays, no per-token Python objects.

Bounded before tokenization: when at most ``max_tokens`` tokens of an example can be kept (``max_length``), a
text (or a completion after its prompt) far longer than that many tokens can span is not tokenized whole. Its
prefixes of about C and 2C characters are tokenized (C doubling from a budget of a few characters per token),
each cut where a word ends, until both hold the needed tokens and agree on them. A cut between words leaves every
word before it whole (pre-tokenizers split at whitespace: byte-level BPE, WordPiece, Metaspace), so the tokens
before it are those the whole text gives; the agreement of two cuts guards tokenizers without pre-tokenization.
A text that never settles is tokenized whole, as are all texts shorter than four budgets, so time and memory are
set by ``max_length``, not by the text, and the kept tokens are those of tokenizing everything and truncating.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chat import chat_tokens, common_prefix
from .errors import DataError

__all__ = ["TokenChunk", "flat_tokens", "prefix_lengths", "tokenize_chunk"]


@dataclass
class TokenChunk:
    """Tokenized examples, concatenated.

    tokens: ``[N]`` int64 token ids of every example, one after another.
    loss: ``[N]`` bool, True where the token is a label (in the loss).
    lengths: ``[E]`` tokens per example.
    keep_from: ``[E]`` first token of the part truncation keeps (completion or first assistant token; 0 for text).
    partial: ``[E]`` bool, True where the example was cut before tokenization: its tokens are only the first ones,
        more than can be kept, and its length is a lower bound (None: every example was tokenized whole).
    """

    tokens: np.ndarray
    loss: np.ndarray
    lengths: np.ndarray
    keep_from: np.ndarray
    partial: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        """``[E + 1]`` start of each example in the flat arrays."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def example_of_token(self) -> np.ndarray:
        """``[N]`` index of the example each token belongs to."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)


def flat_tokens(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(flat [N] int64, lengths [E])`` of a list of token lists."""
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def prefix_lengths(prefix: np.ndarray, prefix_lengths_: np.ndarray, full: np.ndarray,
                   full_lengths: np.ndarray) -> np.ndarray:
    """``[E]`` common prefix length of each pair (flat arrays with lengths), without a loop over examples."""
    n = np.minimum(prefix_lengths_, full_lengths)
    out = n.copy()
    total = int(n.sum())
    if total == 0:
        return out
    example = np.repeat(np.arange(len(n)), n)
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    local = np.arange(total) - start[example]
    p_off = np.concatenate([[0], np.cumsum(prefix_lengths_)[:-1]])
    f_off = np.concatenate([[0], np.cumsum(full_lengths)[:-1]])
    differ = prefix[p_off[example] + local] != full[f_off[example] + local]
    first = np.full(len(n), np.iinfo(np.int64).max)
    np.minimum.at(first, example[differ], local[differ])
    return np.minimum(out, first)


def tokenize_chunk(records: list[dict[str, Any]], wheres: list[str], tokenizer: Any, fmt: str, conversational: bool,
                   targets: str, fields: Any, add_eos: bool = False, max_tokens: int | None = None) -> TokenChunk:
    """Tokenize records of format ``fmt`` (``targets``: ``all``, ``completion`` or ``assistant`` in the loss;
    ``add_eos``: end each text with the EOS token, format text only). ``max_tokens``: the most tokens truncation
    keeps of an example (``max_length``); a text or completion far longer is cut before it is tokenized
    (``TokenChunk.partial``; strings only: conversations are rendered whole)."""
    if fmt == "text":
        texts = [r[fields.text] for r in records]
        if add_eos:
            eos = _eos(tokenizer, "--eos appends to each text")
            texts = [t if t.endswith(eos) else t + eos for t in texts]
        need = None if max_tokens is None else [max_tokens + 1] * len(texts)  # one more: "too long" stays known
        ids, partial = _encode(tokenizer, texts, need)
        flat, lengths = flat_tokens(ids)
        return TokenChunk(flat, np.ones(len(flat), dtype=bool), lengths, np.zeros(len(lengths), dtype=np.int64),
                          partial)
    if fmt == "prompt-completion" and not conversational:
        return _prompt_completion(records, tokenizer, targets, fields, max_tokens)
    return _conversations(records, wheres, tokenizer, fmt, targets, fields)


_CHARS_PER_TOKEN = 8  # first character budget per needed token (doubled until the prefix holds them)
_MIN_CHARS = 1024
_WHOLE_BELOW = 4  # a text shorter than this many budgets is tokenized whole
_MARGIN = 4  # tokens the shorter prefix holds past the needed ones (a post-processor's trailing special tokens)


def _call(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def _encode(tokenizer: Any, texts: list[str], need: list[int] | None = None, skip: list[int] | None = None,
            skipped: list[int] | None = None) -> tuple[list[list[int]], np.ndarray | None]:
    """Token ids of each text (special tokens added), and ``[E]`` bool: cut before tokenization (None: no text
    was). ``need``: ``[E]`` leading tokens of each text that are all that can be used (None: all of them); a text
    much longer is tokenized by prefixes (:func:`_prefix_ids`). ``skip``: ``[E]`` characters at its start that
    are always tokenized (a prompt), ``skipped``: about how many of the needed tokens they hold (the character
    budget is for the rest)."""
    if need is None:
        return _call(tokenizer, texts), None
    skip = skip if skip is not None else [0] * len(texts)
    skipped = skipped if skipped is not None else [0] * len(texts)
    ids: list[list[int] | None] = [_prefix_ids(tokenizer, t, n, s, k)
                                   for t, n, s, k in zip(texts, need, skip, skipped)]
    partial = np.array([row is not None for row in ids], dtype=bool)
    whole = [i for i, row in enumerate(ids) if row is None]
    for i, row in zip(whole, _call(tokenizer, [texts[i] for i in whole]) if whole else []):
        ids[i] = row
    return ids, partial  # type: ignore[return-value]


def _prefix_ids(tokenizer: Any, text: str, need: int, skip: int, skipped: int = 0) -> list[int] | None:
    """The first ``need`` token ids of ``text``, tokenized from prefixes (``skip`` characters, which hold about
    ``skipped`` of the needed tokens, and a budget for the others that doubles, each cut where a word ends:
    :func:`_cut`) until two consecutive ones agree on them; None where the text is short enough to be tokenized
    whole, or the prefixes reach its end first."""
    budget = _MIN_CHARS + _CHARS_PER_TOKEN * max(need - skipped, 1)
    if len(text) - skip <= _WHOLE_BELOW * budget:
        return None
    cut = _cut(text, skip, skip + budget)
    shorter = _call(tokenizer, [text[:cut]])[0]
    while True:
        budget *= 2
        if skip + budget >= len(text):
            return None
        further = _cut(text, skip, skip + budget)
        if further == cut:  # one word longer than the budget: no new evidence yet
            continue
        longer = _call(tokenizer, [text[:further]])[0]
        if len(shorter) >= need + _MARGIN and list(shorter[:need]) == list(longer[:need]):
            return list(longer[:need])
        cut, shorter = further, longer


def _cut(text: str, skip: int, end: int) -> int:
    """Where to cut ``text`` at or before character ``end``: where the last word that ends after ``skip`` ends
    (before a whitespace run), so that no word is cut -- pre-tokenizers split at whitespace, and a word's tokens
    then do not depend on what follows -- else (no whitespace there) at ``end``."""
    space = max(text.rfind(c, skip, end) for c in " \t\n\r")
    word_end = skip + len(text[skip:space].rstrip()) if space > skip else skip
    return word_end if word_end > skip else end


def _eos(tokenizer: Any, use: str) -> str:
    """The tokenizer's EOS token text; ``use`` says what needs it, for the error when there is none."""
    if tokenizer.eos_token is None:
        raise DataError(f"the tokenizer has no EOS token, which {use} (as TRL does); set tokenizer.eos_token")
    return tokenizer.eos_token


def _prompt_completion(records: list[dict[str, Any]], tokenizer: Any, targets: str, fields: Any,
                       max_tokens: int | None = None) -> TokenChunk:
    eos = _eos(tokenizer, "prompt/completion data appends to each completion")
    prompts = [r[fields.prompt] for r in records]
    full = [p + (c if c.endswith(eos) else c + eos) for p, c in zip(prompts, (r[fields.completion] for r in records))]
    prompt_ids, _ = _encode(tokenizer, prompts)
    prompt_flat, prompt_lengths = flat_tokens(prompt_ids)
    # truncation keeps at most max_tokens from one token before the completion: the prompt and that many more
    need = None if max_tokens is None else [len(p) + max_tokens + 1 for p in prompt_ids]
    full_ids, partial = _encode(tokenizer, full, need, [len(p) for p in prompts], [len(p) for p in prompt_ids])
    flat, lengths = flat_tokens(full_ids)
    start = prefix_lengths(prompt_flat, prompt_lengths, flat, lengths)  # [E] first completion token
    position = np.arange(len(flat)) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    loss = position >= np.repeat(start, lengths) if targets == "completion" else np.ones(len(flat), dtype=bool)
    return TokenChunk(flat, loss, lengths, start, partial)


def _conversations(records: list[dict[str, Any]], wheres: list[str], tokenizer: Any, fmt: str, targets: str,
                   fields: Any) -> TokenChunk:
    ids_list: list[list[int]] = []
    masks: list[np.ndarray] = []
    keep = np.zeros(len(records), dtype=np.int64)
    for i, (record, where) in enumerate(zip(records, wheres)):
        if fmt == "messages":
            messages = record[fields.messages]
            has_assistant = any(m["role"] == "assistant" for m in messages)
            if not has_assistant and targets == "assistant":
                raise DataError(f"{where} has no assistant turn, so nothing of it is in an assistant-only loss; "
                                "remove it, or pass --loss-on all")
            ids, assistant = chat_tokens(tokenizer, messages, where, assistant_mask=has_assistant)
            if assistant is not None and not assistant.any():
                raise DataError(f"{where}: the chat template marks no token of the assistant turns; check its "
                                "{% generation %} markers")
            mask = assistant if targets == "assistant" else np.ones(len(ids), dtype=bool)
            keep[i] = int(np.argmax(assistant)) if assistant is not None else 0
        else:
            prompt, completion = record[fields.prompt], record[fields.completion]
            prompt_ids, _ = chat_tokens(tokenizer, prompt, where, add_generation_prompt=True)
            ids, assistant = chat_tokens(tokenizer, prompt + completion, where,
                                         assistant_mask=targets == "assistant")
            start = common_prefix(prompt_ids, ids)
            mask = np.arange(len(ids)) >= start if targets != "all" else np.ones(len(ids), dtype=bool)
            if assistant is not None:
                mask &= assistant
            keep[i] = start
        ids_list.append(ids)
        masks.append(mask)
    flat, lengths = flat_tokens(ids_list)
    loss = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    return TokenChunk(flat, loss, lengths, keep)
