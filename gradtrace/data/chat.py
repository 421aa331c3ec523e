"""Chat templates: a conversation's tokens and which of them the assistant wrote.

With ``{% generation %}`` markers in the template, the assistant mask is the one ``apply_chat_template``
returns (``return_assistant_tokens_mask=True``), exactly what TRL's ``assistant_only_loss`` trains on.
Without them, each assistant turn is found by rendering the conversation turn by turn: the turn's tokens
run from the end of the conversation before it (rendered with the generation prompt, e.g.
``<|assistant|>\\n``) to the end of the conversation including it, so the turn's end-of-turn tokens are in
the loss -- the model learns to stop -- and the role header is not.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .errors import DataError

__all__ = ["chat_tokens", "check_chat_template", "common_prefix", "has_generation_markers"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def check_chat_template(tokenizer: Any, where: str) -> None:
    """Conversational data needs a chat template: a clear error when the tokenizer has none."""
    if _template(tokenizer) is None:
        raise DataError(f"{where} is conversational but the tokenizer has no chat template; save one with the "
                        "tokenizer (tokenizer.chat_template = ...; save_pretrained), or give prompt/completion "
                        "strings")


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = _template(tokenizer)
    return template is not None and _GENERATION.search(template) is not None


def common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    n = min(len(ids), len(other))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(ids[:n]) != np.asarray(other[:n]))
    return int(diff[0]) if len(diff) else n


def _render(tokenizer: Any, messages: list[dict[str, Any]], where: str, **kwargs: Any) -> dict[str, Any]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as err:  # jinja2 TemplateError (e.g. roles must alternate), ValueError, ...
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{where}: the chat template cannot render this conversation ({message})") from None
    return out


def chat_tokens(tokenizer: Any, messages: list[dict[str, Any]], where: str, *, assistant_mask: bool = False,
                add_generation_prompt: bool = False) -> tuple[list[int], np.ndarray | None]:
    """Token ids of a conversation rendered by the chat template, and (``assistant_mask``) a ``[T]`` bool
    mask of the assistant's tokens (markers when the template has them, else turn-by-turn rendering)."""
    if not assistant_mask:
        return list(_render(tokenizer, messages, where, add_generation_prompt=add_generation_prompt)["input_ids"]), None
    if has_generation_markers(tokenizer):
        out = _render(tokenizer, messages, where, return_assistant_tokens_mask=True,
                      add_generation_prompt=add_generation_prompt)
        return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)
    ids = list(_render(tokenizer, messages, where, add_generation_prompt=add_generation_prompt)["input_ids"])
    mask = np.zeros(len(ids), dtype=bool)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], where, add_generation_prompt=True)["input_ids"] if turn else []
        upto = _render(tokenizer, messages[:turn + 1], where)["input_ids"]
        mask[common_prefix(list(before), ids):common_prefix(list(upto), ids)] = True
    return ids, mask
