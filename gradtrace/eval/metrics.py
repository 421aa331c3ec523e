"""Attribution quality metrics: LDS, correlation with leave-one-out effects, recall@k.

Every metric is computed per query and summarised as a :class:`QueryMetric`: the per-query values, their
mean and its standard error ``std / sqrt(Q)`` (sample standard deviation, ``ddof = 1``, over the queries
whose value is defined). A query whose value is undefined -- a correlation with a constant side, a recall
with no relevant example -- is ``nan`` in ``per_query`` and left out of the mean and the standard error;
``n`` says how many queries were counted.

Sign convention: scores are positive when the training example helps the query (lowers its loss), and
the ground truths here are oriented the same way (LDS outcomes are ``-loss``; leave-one-out effects are
positive when removing the example raises the query's loss), so a good method has positive correlations.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..grad.quantize import spearman

__all__ = ["LDSResult", "QueryMetric", "lds", "loo_correlation", "pearson", "recall_at_k", "summarize"]


@dataclass(frozen=True)
class QueryMetric:
    """A metric's per-query values ``[Q]`` (float64, ``nan`` where undefined), their mean over the defined
    queries and its standard error ``std / sqrt(n)`` (``ddof = 1``; ``nan`` when ``n < 2``)."""

    per_query: Tensor
    mean: float
    se: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.se:.3f}"


LDSResult = QueryMetric


def summarize(per_query: Tensor) -> QueryMetric:
    """Mean and standard error ``std / sqrt(n)`` of the finite entries of ``per_query`` ``[Q]``."""
    values = per_query.to(torch.float64)
    finite = values[torch.isfinite(values)]
    n = int(finite.numel())
    mean = float(finite.mean()) if n else math.nan
    se = float(finite.std(unbiased=True) / math.sqrt(n)) if n > 1 else math.nan
    return QueryMetric(values, mean, se, n)


def _matrix(scores: Any) -> Tensor:
    matrix = getattr(scores, "matrix", scores)
    if matrix is None:
        raise ValueError("these Scores kept only a top-k; score with matrix=True for this metric")
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        raise ValueError(f"scores must be a [Q, N] tensor or Scores with a matrix, got {type(matrix).__name__}")
    return matrix


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """Pearson correlation of matching rows of ``[Q, N]`` tensors: ``[Q]`` float64 (``nan`` for a constant row)."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"pearson expects two [Q, N] tensors of equal shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    a = a.to(torch.float64) - a.to(torch.float64).mean(dim=1, keepdim=True)
    b = b.to(torch.float64) - b.to(torch.float64).mean(dim=1, keepdim=True)
    return (a * b).sum(dim=1) / torch.sqrt((a * a).sum(dim=1) * (b * b).sum(dim=1))


def lds(scores: Any, masks: Tensor, outcomes: Tensor) -> QueryMetric:
    """Linear datamodeling score (Park et al. 2023, TRAK).

    The prediction for subset ``s`` and query ``q`` is the sum of the query's scores over the subset's
    training examples, ``g_s(q) = sum_{i in D_s} scores[q, i]``; ``LDS(q)`` is the Spearman correlation
    (average ranks for ties) over subsets between ``g_s(q)`` and the measured ``outcomes[s, q]``.

    Args:
        scores: ``[Q, N]`` attribution scores (or :class:`gradtrace.Scores` with a matrix), positive = helps.
        masks: ``[S, N]`` bool, ``masks[s, i]`` = training example ``i`` is in subset ``s``.
        outcomes: ``[S, Q]`` outcome of each query under the model retrained on each subset (``-loss``:
            higher is better, matching the sign of the scores).

    Returns:
        :class:`QueryMetric` with ``LDS(q)`` per query, the mean and its standard error ``std / sqrt(Q)``.
    """
    matrix = _matrix(scores)
    num_q, num_train = matrix.shape
    if masks.dim() != 2 or masks.shape[1] != num_train:
        raise ValueError(f"masks must be [S, {num_train}] (one column per training example), got {tuple(masks.shape)}")
    if masks.dtype != torch.bool:
        raise ValueError(f"masks must be bool, got {masks.dtype}")
    if tuple(outcomes.shape) != (masks.shape[0], num_q):
        raise ValueError(f"outcomes must be [S, Q] = [{masks.shape[0]}, {num_q}], got {tuple(outcomes.shape)}")
    predictions = masks.to(torch.float64) @ matrix.to(torch.float64).t()  # [S, Q]
    return summarize(spearman(predictions.t().contiguous(), outcomes.to(torch.float64).t().contiguous()))


def loo_correlation(scores: Any, effects: Tensor, kind: str = "pearson") -> QueryMetric:
    """Per-query correlation, over training examples, between scores and leave-one-out effects.

    Args:
        scores: ``[Q, N]`` scores (or Scores with a matrix); select the columns of the examples whose effects
            were measured (``scores[:, indices]``).
        effects: ``[Q, N]`` measured effects, positive when the example helped (removing it raised the
            query's loss), as :func:`gradtrace.eval.build_loo_ground_truth` returns them.
        kind: ``"pearson"`` or ``"spearman"`` (average ranks for ties).

    Returns:
        :class:`QueryMetric`: correlations per query, mean and standard error ``std / sqrt(Q)``.
    """
    matrix = _matrix(scores)
    if matrix.shape != effects.shape:
        raise ValueError(f"scores {tuple(matrix.shape)} and effects {tuple(effects.shape)} differ in shape")
    if kind == "pearson":
        return summarize(pearson(matrix, effects))
    if kind == "spearman":
        return summarize(spearman(matrix.to(torch.float64), effects.to(torch.float64)))
    raise ValueError(f"kind must be 'pearson' or 'spearman', got {kind!r}")


def recall_at_k(scores: Any, relevant: Sequence[Collection[int | str]], k: int,
                train_ids: Sequence[str] | None = None) -> QueryMetric:
    """Fraction of each query's relevant training examples found among its ``k`` highest scores.

    Args:
        scores: ``[Q, N]`` tensor or :class:`gradtrace.Scores` (matrix or a kept top-k of at least ``k``).
        relevant: per query, a collection of relevant training examples: indices into the columns, or
            ids (strings) looked up in ``scores.train_ids`` (or ``train_ids``).
        k: how many top-scored examples to look at.

    Returns:
        :class:`QueryMetric` with ``|top-k ∩ relevant| / |relevant|`` per query (``nan`` for a query with
        no relevant example), the mean and its standard error ``std / sqrt(Q)``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ids = list(train_ids) if train_ids is not None else getattr(scores, "train_ids", None)
    if isinstance(scores, Tensor):
        top = torch.topk(scores, min(k, scores.shape[1]), dim=1).indices
        num_q, num_train = scores.shape
    else:
        top = scores.topk(k).indices
        num_q, num_train = scores.shape
    if len(relevant) != num_q:
        raise ValueError(f"relevant holds {len(relevant)} entries for {num_q} queries")
    position = {ident: i for i, ident in enumerate(ids)} if ids is not None else None
    relevant_mask = torch.zeros(num_q, num_train, dtype=torch.bool)
    for q, items in enumerate(relevant):
        columns = []
        for item in items:
            if isinstance(item, str):
                if position is None:
                    raise ValueError("relevant ids need Scores (or train_ids=...) to map them to columns")
                if item not in position:
                    raise ValueError(f"relevant id {item!r} of query {q} is not a training id")
                columns.append(position[item])
            else:
                columns.append(int(item))
        if columns:
            relevant_mask[q, torch.tensor(columns, dtype=torch.long)] = True
    found = relevant_mask.gather(1, top).sum(dim=1).to(torch.float64)
    total = relevant_mask.sum(dim=1).to(torch.float64)
    per_query = torch.where(total > 0, found / total.clamp(min=1), torch.full_like(total, math.nan))
    return summarize(per_query)
