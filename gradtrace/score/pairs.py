"""Attributions of single (query, training example) pairs: the score of each top-k pair split by parameter
block (module-level) and by token (token-level).

Both are exact decompositions of the pair's score, in the shapes ``Scores.meta["modules"]`` and
``Scores.meta["tokens"]`` that the HTML report reads (``docs/report.md``):

* module-level: ``score(q, i) = sum_b <prepared_q[b], train_i[b]>`` over the parameter blocks ``b`` of the
  spec (``GradientSpec.offsets``); for influence methods ``prepared_q`` is the preconditioned query, so the
  split is that of the preconditioned query against the raw training row.
* token-level (:func:`token_attributions`): ``score(q, i) = sum_t score(q_t, i)`` with per-token query
  gradients, and ``score(q, i) = sum_s score(q, i_s)`` with per-token gradients of the training example.

Only the pairs kept by the streaming top-k (highest and lowest) are decomposed: ``O(Q * k)`` pairs, one
matrix product per parameter block over the distinct training rows involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .scores import Scores

__all__ = ["PairRows", "module_attributions", "pair_rows", "read_rows"]


class PairRows:
    """The (query, training example) pairs of a top-k: ``queries``/``train`` are ``[P]`` row numbers into
    ``Scores.query_ids``/``Scores.train_ids``, with the top and bottom ``k`` of every query (each pair once)."""

    def __init__(self, queries: Tensor, train: Tensor) -> None:
        self.queries, self.train = queries, train

    def __len__(self) -> int:
        return int(self.queries.numel())


def pair_rows(scores: Scores, k: int | None = None) -> PairRows:
    """The top and bottom ``k`` pairs of every query of ``scores`` (``k=None``: as many as were kept)."""
    if k is None:
        if scores.top is None:
            raise ValueError("these scores kept no top-k: pass k (the number of pairs per query to decompose)")
        k = int(scores.top[0].shape[1])
    top, bottom = scores.topk(k, largest=True), scores.topk(k, largest=False)
    num_q = len(scores.query_ids)
    train = torch.cat([top.indices, bottom.indices], dim=1)  # [Q, 2k]
    queries = torch.arange(num_q).unsqueeze(1).expand_as(train)
    keys = torch.unique(queries.reshape(-1) * len(scores.train_ids) + train.reshape(-1))  # each pair once, sorted
    return PairRows(keys // len(scores.train_ids), keys % len(scores.train_ids))


def read_rows(source: Any, rows: Tensor, device: torch.device | str | None = None) -> Tensor:
    """``[len(rows), D]`` float32 training rows at ``rows`` of a store (random access) or an in-memory set."""
    if hasattr(source, "rows"):
        return source.rows(rows.tolist(), device).to(torch.float32)
    return source.read(0, len(source), device)[rows.to(device if device is not None else "cpu")].to(torch.float32)


def _query_positions(query_ids: Sequence[str], scores: Scores) -> Tensor:
    """Rows of ``query_ids`` holding each of the scores' queries (ValueError naming a missing one)."""
    where = {str(q): i for i, q in enumerate(query_ids)}
    missing = [q for q in scores.query_ids if q not in where]
    if missing:
        raise ValueError(f"queries {missing[:3]} of the scores are not among the query gradients given; pass the "
                         "queries the scores were computed from")
    return torch.tensor([where[q] for q in scores.query_ids], dtype=torch.long)


def module_attributions(attributor: Any, queries: Any, scores: Scores, k: int | None = None) -> list[dict[str, Any]]:
    """Module-level attribution of the top and bottom ``k`` pairs of every query of ``scores``.

    Returns ``[{"query_id", "train_id", "modules": {parameter block: share}}, ...]`` (the shape of
    ``Scores.meta["modules"]``); each pair's shares sum to its score up to float32 round-off of the score
    itself (the shares are accumulated in float64). Works for every method whose prepared vectors keep the
    spec's layout: the query side is ``method.prepare_queries`` (preconditioned for influence methods), the
    training side ``method.prepare_train``, checkpoints weighted as in scoring.
    """
    method = attributor.method
    method.check_ready()
    if hasattr(method, "bind"):
        method.bind(attributor.spec)
    query_sets = attributor._query_sets(queries)
    weights = (method.checkpoint_weights(len(attributor.train)) if hasattr(method, "checkpoint_weights")
               else [1.0] * len(attributor.train))
    if list(scores.train_ids) != attributor.train_ids:
        raise ValueError("the scores were computed against other training gradients than this attributor's")
    pairs = pair_rows(scores, k)
    unique, inverse = torch.unique(pairs.train, return_inverse=True)  # [U] training rows, [P] into them
    offsets = attributor.spec.offsets()
    shares = torch.zeros(len(pairs), len(offsets), dtype=torch.float64)  # [P, blocks]
    for c, (query_set, source) in enumerate(zip(query_sets, attributor.train)):
        source.spec.check_compatible(query_set.spec, f"queries vs training gradients (checkpoint {c})")
        raw = query_set.read(0, len(query_set), attributor.device).to(torch.float32)
        prepared = method.prepare_queries(raw, c)[_query_positions(query_set.ids, scores).to(raw.device)]  # [Q, D]
        train = method.prepare_train(read_rows(source, unique, attributor.device), c)  # [U, D]
        if prepared.shape[1] != attributor.spec.dim or train.shape[1] != attributor.spec.dim:
            raise ValueError(f"{method.name} transforms gradients out of the spec's layout ({attributor.spec.dim} "
                             "dims); module-level attribution needs per-parameter slices")
        for b, (start, stop) in enumerate(offsets.values()):
            block = prepared[:, start:stop].double() @ train[:, start:stop].double().t()  # [Q, U]
            shares[:, b] += weights[c] * block[pairs.queries, inverse].cpu()
    names = list(offsets)
    return [{"query_id": scores.query_ids[q], "train_id": scores.train_ids[t],
             "modules": dict(zip(names, row))}
            for q, t, row in zip(pairs.queries.tolist(), pairs.train.tolist(), shares.tolist())]

