"""Which ids a gradient set holds, and what it left out: the one rule for stores and in-memory sets.

Rows are kept by :func:`~gradtrace.store.spec.first_occurrences` (the first row of an id; a repeat of the same
example is counted, another example under a kept id is an :class:`~gradtrace.store.IdCollision`), and rows with
NaN/inf values are not kept (warned about, their ids listed). :class:`~gradtrace.store.ShardWriter` keeps one
ledger per rank (filled with the ids already stored when it resumes); the in-memory row sink keeps one too, so
both leave out exactly the same rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .spec import first_occurrences

__all__ = ["IdLedger"]


class IdLedger:
    """The ids kept so far (with their content digests) and the counts of rows skipped.

    place: where the kept rows are, for error messages (``"runs/train"``). ``skipped``: ``{"nonfinite": [ids],
    "already_stored": count, "duplicate": count}`` (``already_stored``: repeats of ids kept before
    :meth:`mark_resumed`).
    """

    def __init__(self, place: str) -> None:
        self.place = place
        self.ids: set[str] = set()
        self.digests: dict[str, str] = {}  # content digest of each kept id that has one
        self.resumed: frozenset[str] = frozenset()
        self.skipped: dict[str, Any] = {"nonfinite": [], "already_stored": 0, "duplicate": 0}

    def add_existing(self, ids: Sequence[str], digests: Iterable[str | None] | None) -> None:
        """Record rows kept by an earlier run (a resumed store's shards)."""
        self.ids.update(ids)
        if digests is not None:
            self.digests.update((i, d) for i, d in zip(ids, digests) if d is not None)

    def mark_resumed(self) -> None:
        """From now on, repeats of the ids kept so far count as ``already_stored``."""
        self.resumed = frozenset(self.ids)

    def select_new(self, ids: Sequence[str], digests: Sequence[str | None] | None = None) -> list[int]:
        """Positions of the ``ids`` not kept yet (first occurrence); the others are counted as skipped, and the
        kept ones are taken as kept from now on. An id seen before with another digest raises
        :class:`~gradtrace.store.IdCollision` (nothing of this call is kept then)."""
        keep, new, repeats = first_occurrences(
            ids, digests, lambda ident: (ident in self.ids, self.digests.get(ident)),
            lambda ident: f"{'stored in' if ident in self.resumed else 'written earlier in this run to'} {self.place}")
        for ident in repeats:
            self.skipped["already_stored" if ident in self.resumed else "duplicate"] += 1
        self.ids.update(new)
        self.digests.update((i, d) for i, d in new.items() if d is not None)
        return keep

    def note_nonfinite(self, ids: Sequence[str]) -> None:
        """Record ids whose gradients held NaN/inf (not kept; a store lists them in the rank status file)."""
        listed = set(self.skipped["nonfinite"])
        self.skipped["nonfinite"] += [i for i in ids if i not in listed and i not in self.ids]

    def finite_rows(self, ids: Sequence[str], vectors: Tensor, *, selected: bool) -> list[int]:
        """Positions of the rows of ``vectors`` ``[n, dim]`` without NaN/inf. The others are warned about and
        recorded (:meth:`note_nonfinite`); ``selected``: their ids passed :meth:`select_new` and are let go."""
        finite = (torch.isfinite(vectors).all(dim=1).cpu() if vectors.numel()
                  else torch.ones(len(ids), dtype=torch.bool))
        if not bool(finite.all()):
            bad = [ids[i] for i in (~finite).nonzero().flatten().tolist()]
            warnings.warn(f"gradtrace: {len(bad)} row(s) with NaN/inf values are not stored: {bad[:5]}", stacklevel=3)
            if selected:
                self.ids.difference_update(bad)
                for ident in bad:
                    self.digests.pop(ident, None)
            self.note_nonfinite(bad)
        return finite.nonzero().flatten().tolist()  # one pass, not a tensor read per row
