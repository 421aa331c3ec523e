"""Where each captured example's id comes from.

In order of precedence: ids stated for the forward call (:meth:`Capture.annotate`), ids given to the capture
(consumed in order), else a content hash of the example's unpadded inputs, numbered as
:class:`gradtrace.data.ids.ContentIds` numbers them (a repeat in one epoch is ``hash#2``).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from typing import Any

from ..data.ids import ContentIds
from ..store.spec import IdCollision
from .context import ForwardContext

__all__ = ["ExampleIds"]


class ExampleIds:
    """The ids of a capture's examples, forward call by forward call.

    Args:
        ids: ids consumed in order (one per example, per document for packed rows), or None.
    """

    def __init__(self, ids: Sequence[Any] | None) -> None:
        self._given = iter(ids) if ids is not None else None
        self._content = ContentIds()
        self._first: tuple[str, Any] | None = None  # the type of the first user id and that id (see strings)

    def resolve(self, context: ForwardContext) -> tuple[list[str], list[str] | None]:
        """The ids of one forward call's examples and their content digests (a hash of each example's
        unpadded inputs; None when the inputs cannot be hashed). Stores and ``GradientSet`` use the digests to
        tell a repeat of an example (same id, same digest: skipped) from two examples sharing an id (an error)."""
        count = context.num_examples
        try:
            digests = context.content_ids()
        except (ValueError, TypeError, RuntimeError):  # no input tensor, or one numpy cannot hold (bf16)
            digests = None
        if context.user_ids is not None:
            return self.strings(context.user_ids), digests
        if self._given is not None:
            taken = list(itertools.islice(self._given, count))
            if len(taken) < count:
                raise ValueError(f"gradtrace: the ids list ran out: {count} examples in this batch but only "
                                 f"{len(taken)} ids left")
            return self.strings(taken), digests
        hashed = context.content_ids() if digests is None else digests  # raises when nothing can be hashed
        return self._content.number(hashed), digests

    def strings(self, ids: Sequence[Any]) -> list[str]:
        """User ids as strings; ids of two types in one run (``1`` and ``"1"``) would become the same string
        and are refused (:class:`~gradtrace.store.IdCollision` naming both)."""
        for ident in ids:
            kind = _id_kind(ident)
            if self._first is None:
                self._first = (kind, ident)
            elif kind != self._first[0]:
                first_kind, first = self._first
                raise IdCollision(f"gradtrace: ids of two types in one run: {first!r} ({first_kind}) and {ident!r} "
                                  f"({kind}); stored as strings they can collide (1 and '1' are the same id). Give "
                                  "every id the same type")
        return [str(i) for i in ids]

    def unused(self) -> int:
        """How many of the given ids were never used (consumes them; 0 without given ids)."""
        return 0 if self._given is None else sum(1 for _ in self._given)

    def reset(self) -> None:
        """Forget seen content hashes (a new epoch: repeated content is the same example again)."""
        self._content.reset()


def _id_kind(ident: Any) -> str:
    """``"int"`` for Python and numpy integers, ``"str"`` for strings, else the type's name."""
    if isinstance(ident, str):
        return "str"
    if isinstance(ident, numbers.Integral) and not isinstance(ident, bool):
        return "int"
    return type(ident).__name__
