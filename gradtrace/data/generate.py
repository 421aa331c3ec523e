"""The model's own answers as queries: decode an answer to each prompt and attribute its loss.

``load(source, tokenizer, generate=Generate(model))`` reads query *prompts* (a ``prompt`` field, a ``text``
field or a ``.txt`` line; or a ``messages`` conversation, answered as the assistant), decodes the model's
answer (greedy by default, sampled with ``temperature > 0`` from a seeded generator) and makes each query
the prompt followed by the answer's tokens, the answer alone in the loss. The answer's token ids are used as
generated (never re-tokenized from the decoded text), so the query loss is the model's loss on exactly the
tokens it produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .chat import chat_tokens, check_chat_template
from .errors import DataError
from .tokenize import TokenChunk, flat_tokens

__all__ = ["Generate", "generate_chunk", "prompt_of"]


@dataclass
class Generate:
    """How the model answers each query prompt.

    model: the model that answers (a Hugging Face causal LM with ``generate``).
    max_new_tokens: longest answer. temperature: 0 decodes greedily; above 0 samples at that temperature
    (no top-k / top-p). seed: seeds the sampling of every prompt (the same seed gives the same answers).
    """

    model: Any
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DataError(f"--max-new-tokens {self.max_new_tokens}: an answer needs at least one token")
        if self.temperature < 0:
            raise DataError(f"--temperature {self.temperature} must be 0 (greedy) or positive")


def prompt_of(record: dict[str, Any], fields: Any, where: str) -> str | list[dict[str, Any]]:
    """The prompt of a query record: its prompt field, else its text field, else its conversation."""
    for name in (fields.prompt, fields.text, fields.messages):
        value = record.get(name)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in value):
            return value
    found = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise DataError(f"{where} has no prompt to answer (it has: {found}); give a non-empty {fields.prompt!r} or "
                    f"{fields.text!r} string, or a {fields.messages!r} conversation (--prompt-field, --text-field, "
                    "--messages-field)")


def _limit(model: Any) -> int | None:
    from ..common.modules import context_limit

    return context_limit(model)


def generate_chunk(records: list[dict[str, Any]], wheres: list[str], tokenizer: Any, fields: Any,
                   gen: Generate) -> tuple[TokenChunk, list[str]]:
    """Answer each record's prompt: the prompt + answer tokens (answer in the loss), and the decoded answers."""
    model = gen.model
    device = next(model.parameters()).device
    limit = _limit(model)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids_list: list[list[int]] = []
    starts: list[int] = []
    answers: list[str] = []
    was_training = model.training
    model.eval()
    try:
        for record, where in zip(records, wheres):
            prompt = prompt_of(record, fields, where)
            if isinstance(prompt, str):
                prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
            else:
                check_chat_template(tokenizer, where)
                prompt_ids, _ = chat_tokens(tokenizer, prompt, where, add_generation_prompt=True)
            room = gen.max_new_tokens if limit is None else min(gen.max_new_tokens, limit - len(prompt_ids))
            if room < 1:
                raise DataError(f"{where}: the prompt has {len(prompt_ids)} tokens, leaving no room for an answer in "
                                f"the model's context ({limit} tokens); shorten it")
            answer = _decode(model, prompt_ids, room, gen, device, pad, eos)
            ids_list.append(prompt_ids + answer)
            starts.append(len(prompt_ids))
            answers.append(tokenizer.decode(answer, skip_special_tokens=True))
    finally:
        model.train(was_training)
    flat, lengths = flat_tokens(ids_list)
    start = np.asarray(starts, dtype=np.int64)
    position = np.arange(len(flat)) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return TokenChunk(flat, position >= np.repeat(start, lengths), lengths, start), answers


def _decode(model: Any, prompt_ids: list[int], max_new_tokens: int, gen: Generate, device: torch.device,
            pad: int | None, eos: int | None) -> list[int]:
    """One prompt's answer token ids (up to and including the first EOS)."""
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    sample = gen.temperature > 0
    settings: dict[str, Any] = {"do_sample": sample, "max_new_tokens": max_new_tokens, "pad_token_id": pad,
                                "eos_token_id": eos, "top_k": None, "top_p": None,
                                "temperature": gen.temperature if sample else None}
    if sample:
        settings.update(top_k=0, top_p=1.0)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(gen.seed)
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **settings)
    answer = out[0, len(prompt_ids):].tolist()
    if eos is not None and eos in answer:
        answer = answer[:answer.index(eos) + 1]
    return answer
