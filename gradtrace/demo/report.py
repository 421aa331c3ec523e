"""Printing what the planted-fact queries of the demo corpus retrieve (shared by the demo's examples)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..data.corpus import PLANTED
from ..score import Scores

__all__ = ["report_planted"]


def report_planted(scores: Scores, texts: Mapping[str, str], say: Callable[[str], None] = print, *,
                   show: int = 3, k: int = 3, width: int = 50) -> int:
    """Print the top ``k`` training documents of the first ``show`` queries and return the recall@1 hits.

    ``scores`` holds one query per planted fact, in the order of :data:`~gradtrace.data.corpus.PLANTED`;
    ``texts`` maps training ids to their text. A hit is a query whose own planted document ranks first.
    """
    top = scores.topk(k)
    hits = 0
    for q, planted in enumerate(PLANTED[: len(scores.query_ids)]):
        hits += top.ids[q][0] == planted.id
        if q < show:
            say(f"\n{scores.query_ids[q]}: {planted.query}")
            for rank, (tid, value) in enumerate(zip(top.ids[q], top.values[q].tolist()), start=1):
                text = texts[tid].replace("\n", " ")[:width]
                say(f"  {rank}. {value:+.3f}  {tid:<24} {text}{'  <- planted' if tid == planted.id else ''}")
    return hits
