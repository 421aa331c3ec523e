"""Dataset formats (TRL's conventions), detected from a record's fields, and each record's validation.

* ``text``: language modelling, one string (``Fields.text``); every token is in the loss.
* ``prompt-completion``: ``prompt`` and ``completion``, both strings (*standard*) or both lists of
  ``{role, content}`` messages (*conversational*); by default only the completion is in the loss.
* ``messages``: a conversation, a list of ``{role, content}`` messages; by default only the assistant
  turns are in the loss.
* ``preference``: ``chosen`` and ``rejected`` completions (with a ``prompt``, or holding it: TRL's implicit
  prompt), read by :mod:`.preference` (``gradtrace.data.load_preference``): a pair is one example, attributed
  with the DPO loss.

Detection looks at the fields a record has, in TRL's order: chosen + rejected, then prompt + completion, then
messages, then text.
"""

from __future__ import annotations

from typing import Any, Literal

from ..options.data import FORMATS, Fields
from .errors import DataError

__all__ = ["FORMATS", "Fields", "Format", "LossOn", "detect", "has_fields", "loss_targets", "missing_fields_error",
           "preference_error", "validate"]

Format = Literal["text", "prompt-completion", "messages", "preference"]
LossOn = Literal["auto", "completion", "assistant", "all"]


def detect(record: dict[str, Any], fields: Fields) -> Format | None:
    """The format a record's fields say it has (None: no format's fields are there)."""
    if fields.chosen in record and fields.rejected in record:
        return "preference"
    if fields.prompt in record and fields.completion in record:
        return "prompt-completion"
    if fields.messages in record:
        return "messages"
    if fields.text in record:
        return "text"
    return None


def has_fields(record: dict[str, Any], fmt: Format, fields: Fields) -> bool:
    """Whether a record has the fields format ``fmt`` needs."""
    wanted = {"text": [fields.text], "prompt-completion": [fields.prompt, fields.completion],
              "messages": [fields.messages], "preference": [fields.chosen, fields.rejected]}[fmt]
    return all(w in record for w in wanted)


def missing_fields_error(record: dict[str, Any], fields: Fields, where: str, fmt: str) -> DataError:
    """The error for a record without the fields of format ``fmt`` ("auto": of any format)."""
    found = ", ".join(sorted(map(str, record))[:8]) or "none"
    if fmt == "auto":
        needs = f"has no {fields.text!r} field"
        if fields.prompt in record or fields.completion in record:
            present, absent = ((fields.prompt, fields.completion) if fields.prompt in record
                               else (fields.completion, fields.prompt))
            needs = f"has {present!r} but no {absent!r} field"
    else:
        wanted = {"text": [fields.text], "prompt-completion": [fields.prompt, fields.completion],
                  "messages": [fields.messages], "preference": [fields.chosen, fields.rejected]}[fmt]
        needs = "has no " + " / ".join(repr(w) for w in wanted if w not in record) + f" field (format {fmt})"
    return DataError(f"{where} {needs} (it has: {found}); recognised formats: {fields.recognised()}: name your fields "
                     "with --text-field, --prompt-field/--completion-field, --messages-field or "
                     "--chosen-field/--rejected-field, or choose --format")


def preference_error(where: str, fields: Fields) -> DataError:
    """The error for preference pairs read as fine-tuning examples: they are attributed with the DPO loss."""
    return DataError(f"{where} is preference data ({fields.chosen!r} / {fields.rejected!r} pairs): a pair is "
                     "attributed with the DPO loss it was trained with, not as plain fine-tuning text. Read it with "
                     "gradtrace.data.load_preference (Python) or gradtrace collect --format preference --loss dpo "
                     "--ref-model REF_DIR --beta BETA (see docs/post-training.md)")


def loss_targets(fmt: Format, loss_on: LossOn, conversational: bool) -> str:
    """Which tokens are in the loss, resolved: ``all``, ``completion`` or ``assistant``."""
    if loss_on == "auto":
        return {"text": "all", "prompt-completion": "completion", "messages": "assistant"}[fmt]
    chat_pc = ("assistant",) if conversational else ()
    allowed = {"text": ("all",), "prompt-completion": ("completion", "all", *chat_pc),
               "messages": ("assistant", "all")}[fmt]
    if loss_on not in allowed:
        kind = f"{'conversational ' if conversational and fmt == 'prompt-completion' else ''}{fmt}"
        raise DataError(f"--loss-on {loss_on} does not apply to {kind} data; use one of: {', '.join(allowed)}")
    return loss_on


def validate(record: dict[str, Any], fmt: Format, fields: Fields, where: str) -> bool:
    """Check a record of format ``fmt``; returns whether it is conversational (message lists)."""
    if fmt == "text":
        _string(record, fields.text, where)
        return False
    if fmt == "messages":
        _messages(record.get(fields.messages), fields.messages, where)
        return True
    prompt, completion = record.get(fields.prompt), record.get(fields.completion)
    if isinstance(prompt, str) or isinstance(completion, str):
        _string(record, fields.prompt, where)
        _string(record, fields.completion, where)
        if not completion.strip():
            raise DataError(f"{where} has an empty {fields.completion!r}: there is nothing to attribute; remove the "
                            "record or give it a completion")
        return False
    _messages(prompt, fields.prompt, where, need_roles=False)
    _messages(completion, fields.completion, where, need_roles=False)
    if not completion:
        raise DataError(f"{where} has an empty {fields.completion!r} message list; remove the record or give it a "
                        "completion")
    return True


def _string(record: dict[str, Any], field: str, where: str) -> None:
    value = record.get(field)
    if not isinstance(value, str):
        kind = "missing" if field not in record or value is None else f"a {type(value).__name__}"
        raise DataError(f"{where}: {field!r} is {kind}, not a string")


def _messages(value: Any, field: str, where: str, need_roles: bool = True) -> None:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DataError(f"{where}: {field!r} must be a list of {{role, content}} messages, got "
                        f"{type(value).__name__}")
    for i, message in enumerate(value):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {i} of {field!r} needs a string 'role' and 'content' (it has: "
                            f"{', '.join(sorted(map(str, message))) or 'none'})")
    if need_roles and not value:
        raise DataError(f"{where}: {field!r} is an empty conversation")
