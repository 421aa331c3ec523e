"""Do the checkpoints agree? Each member's own top-k, kept while an ensemble (or TracIn's checkpoints) streams.

With several checkpoints or models, the engine also keeps each member's top ``k`` training rows per query (of the
member's own, unweighted scores) and measures how much they overlap: the mean over queries and member pairs of
``|A & B| / |A | B|`` (Jaccard) of their top-``k`` sets, and each member's overlap with the combined top-``k``.
Saved with the scores as ``meta["agreement"]`` and shown by :mod:`gradtrace.score.diagnostics`: members that agree
little rank by different evidence, and the combined ranking then rests on the few that carry the signal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["AGREEMENT_K", "MemberTops", "overlap"]

AGREEMENT_K = 10
"""Top rows per query whose sets are compared."""


def overlap(a: Tensor, b: Tensor) -> float:
    """Mean over rows of the Jaccard overlap of the index sets ``a[q]`` and ``b[q]`` (``[Q, k]`` each)."""
    if a.numel() == 0:
        return 1.0
    same = (a.unsqueeze(2) == b.unsqueeze(1)).any(dim=2).sum(dim=1).to(torch.float64)  # [Q] |A & B|
    union = a.shape[1] + b.shape[1] - same
    return float((same / union).mean())


class MemberTops:
    """Running top-``k`` row indices of each member's ``[Q, n]`` score blocks."""

    def __init__(self, members: int, k: int = AGREEMENT_K) -> None:
        self.k = k
        self.kept: list[tuple[Tensor, Tensor] | None] = [None] * members

    def add(self, member: int, block: Tensor, offset: int) -> None:
        """Merge member ``member``'s scores of rows ``offset : offset + n`` (before any weighting)."""
        take = min(self.k, block.shape[1])
        values, local = torch.topk(block, take, dim=1)
        indices = local + offset
        kept = self.kept[member]
        if kept is not None:
            values, indices = torch.cat([kept[0], values], dim=1), torch.cat([kept[1], indices], dim=1)
            values, order = torch.topk(values, min(self.k, values.shape[1]), dim=1)
            indices = torch.gather(indices, 1, order)
        self.kept[member] = (values, indices)

    def meta(self, combined: Tensor | None) -> dict[str, Any]:
        """``{"k", "pairwise", "with_combined": [per member]}``: the mean pairwise overlap of the members' top-k and
        each member's overlap with the ``combined`` top rows (``[Q, >= k]`` indices; None: not measured)."""
        tops = [kept[1].cpu() for kept in self.kept if kept is not None]
        pairs = [overlap(tops[i], tops[j]) for i in range(len(tops)) for j in range(i + 1, len(tops))]
        out: dict[str, Any] = {"k": self.k, "pairwise": sum(pairs) / len(pairs) if pairs else None}
        if combined is not None:
            head = combined[:, : self.k].cpu()
            out["with_combined"] = [overlap(top, head) for top in tops]
        return out
