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
    """

    tokens: np.ndarray
    loss: np.ndarray
    lengths: np.ndarray
    keep_from: np.ndarray

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
                   targets: str, fields: Any, add_eos: bool = False) -> TokenChunk:
    """Tokenize records of format ``fmt`` (``targets``: ``all``, ``completion`` or ``assistant`` in the loss;
    ``add_eos``: end each text with the EOS token, format text only)."""
    if fmt == "text":
        texts = [r[fields.text] for r in records]
        if add_eos:
            eos = _eos(tokenizer, "--eos appends to each text")
            texts = [t if t.endswith(eos) else t + eos for t in texts]
        flat, lengths = flat_tokens(_encode(tokenizer, texts))
        return TokenChunk(flat, np.ones(len(flat), dtype=bool), lengths, np.zeros(len(lengths), dtype=np.int64))
    if fmt == "prompt-completion" and not conversational:
        return _prompt_completion(records, tokenizer, targets, fields)
    return _conversations(records, wheres, tokenizer, fmt, targets, fields)


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def _eos(tokenizer: Any, use: str) -> str:
    """The tokenizer's EOS token text; ``use`` says what needs it, for the error when there is none."""
    if tokenizer.eos_token is None:
        raise DataError(f"the tokenizer has no EOS token, which {use} (as TRL does); set tokenizer.eos_token")
    return tokenizer.eos_token


def _prompt_completion(records: list[dict[str, Any]], tokenizer: Any, targets: str, fields: Any) -> TokenChunk:
    eos = _eos(tokenizer, "prompt/completion data appends to each completion")
    prompts = [r[fields.prompt] for r in records]
    full = [p + (c if c.endswith(eos) else c + eos) for p, c in zip(prompts, (r[fields.completion] for r in records))]
    prompt_flat, prompt_lengths = flat_tokens(_encode(tokenizer, prompts))
    flat, lengths = flat_tokens(_encode(tokenizer, full))
    start = prefix_lengths(prompt_flat, prompt_lengths, flat, lengths)  # [E] first completion token
    position = np.arange(len(flat)) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    loss = position >= np.repeat(start, lengths) if targets == "completion" else np.ones(len(flat), dtype=bool)
    return TokenChunk(flat, loss, lengths, start)


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
