"""How a dataset is read: which field of a record holds what, how records become examples, how examples are batched.

The three objects :func:`gradtrace.data.load` takes (and the data commands build from their flags):
:class:`Fields`, :class:`ReadOptions` and :class:`BatchOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..common.checks import check_fields
from .base import _choice

FORMATS: tuple[str, ...] = ("text", "prompt-completion", "messages", "preference")
"""The dataset formats (TRL's conventions); ``ReadOptions.format`` also takes ``"auto"``. ``preference`` (``chosen`` /
``rejected`` pairs) is read by :func:`gradtrace.data.load_preference`."""

LOSS_ON: tuple[str, ...] = ("auto", "completion", "assistant", "all")
"""The values of ``ReadOptions.loss_on``."""


@dataclass(frozen=True, kw_only=True)
class Fields:
    """The field (column) names of each part of a record.

    Attributes:
        text: the text of format ``text`` (and of a ``.txt`` file's lines).
        prompt, completion: the two parts of format ``prompt-completion`` (strings or message lists).
        messages: the ``{role, content}`` message list of format ``messages``.
        chosen, rejected: the preferred and the dispreferred completion of format ``preference`` (with ``prompt``,
            or holding the prompt themselves: TRL's implicit prompt).
        id: each example's id (optional: without it, ids are content hashes of the tokens).
    """

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    chosen: str = "chosen"
    rejected: str = "rejected"
    id: str = "id"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Fields.{f.name} must be a non-empty field name, got {value!r}")

    def recognised(self) -> str:
        """The formats and the fields each needs, for error messages."""
        return (f"text ({self.text!r}), prompt-completion ({self.prompt!r} + {self.completion!r}), "
                f"messages ({self.messages!r}), preference ({self.chosen!r} + {self.rejected!r})")


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """Which records of a source are read, and how each becomes an example: its tokens and its loss mask.

    Attributes:
        format: ``"auto"`` (from the fields, as TRL does), ``"text"``, ``"prompt-completion"``, ``"messages"`` or
            ``"preference"`` (:func:`gradtrace.data.load_preference` reads it; ``gradtrace.data.load`` refuses it).
        split: the split of a ``DatasetDict`` (needed when it has several; None for a file or a single dataset).
        loss_on: which tokens are in each example's loss: ``"auto"`` (text: all; prompt-completion: the
            completion; messages: the assistant turns), ``"completion"``, ``"assistant"`` or ``"all"``.
        max_length: longest example in tokens (>= 2; None: no limit). A longer one loses the start of its prompt
            (cut from the left, keeping one token of context before the completion); one whose completion alone
            is too long is an error listing them, unless ``truncate``.
        truncate: cut a text or completion longer than ``max_length`` on the right (and count it) instead of
            refusing it.
        add_eos: format text only: append the tokenizer's EOS token to each text (unless it ends with it), as TRL's
            ``SFTTrainer`` does for language modelling. Off by default: the EOS token then is a target of every
            example, and content-hash ids change with the tokens. (Completions always get it.)
        keep_text: keep each example's text for display (``TokenizedDataset.texts``).
    """

    format: str = "auto"
    split: str | None = None
    loss_on: str = "auto"
    max_length: int | None = field(default=None, metadata={"min": 2})
    truncate: bool = False
    add_eos: bool = False
    keep_text: bool = False

    def __post_init__(self) -> None:
        _choice(self.format, "format", ("auto", *FORMATS))
        _choice(self.loss_on, "loss_on", LOSS_ON)
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    """How examples are batched when a :class:`gradtrace.data.TokenizedDataset` is iterated.

    Attributes:
        batch_size: examples per batch (>= 1).
        pad_id: the padding token of ``input_ids`` (>= 0). None: :func:`gradtrace.data.load` takes the
            tokenizer's pad token, else its EOS token, else 0; a ``TokenizedDataset`` needs it set.
    """

    batch_size: int = field(default=8, metadata={"min": 1})
    pad_id: int | None = field(default=None, metadata={"min": 0})

    def __post_init__(self) -> None:
        check_fields(self)
