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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .scores import Scores

__all__ = ["PairRows", "check_reproduces", "kept_scores", "module_attributions", "pair_rows", "read_rows",
           "sum_tolerance", "token_attributions", "token_records", "token_shares"]


class PairRows:
    """The (query, training example) pairs of a top-k: ``queries``/``train`` are ``[P]`` row numbers into
    ``Scores.query_ids``/``Scores.train_ids``, with the top and bottom ``k`` of every query (each pair once)."""

    def __init__(self, queries: Tensor, train: Tensor) -> None:
        self.queries, self.train = queries, train

    def __len__(self) -> int:
        return int(self.queries.numel())


def pair_rows(scores: Scores, k: int | None = None) -> PairRows:
    """The top and bottom ``k`` pairs of every query of ``scores`` (``k=None``: as many as were kept; the top
    ``k`` alone when the scores kept no bottom-k)."""
    if k is None:
        if scores.top is None:
            raise ValueError("these scores kept no top-k: pass k (the number of pairs per query to decompose)")
        k = int(scores.top[0].shape[1])
    sides = [scores.topk(k, largest=True)] + ([scores.topk(k, largest=False)] if scores.has_bottom else [])
    num_q = len(scores.query_ids)
    train = torch.cat([side.indices for side in sides], dim=1)  # [Q, 2k] (or [Q, k]: no bottom-k kept)
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
    weights = attributor.ready()
    query_sets = attributor._query_sets(queries)
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



def sum_tolerance(parts: Tensor, total: Tensor) -> Tensor:
    """``[P]`` float32 summation bound of ``n`` parts (``[P, n]``) against their totals ``[P]``:
    ``4 * eps32 * n * (sum |parts| + |total|)``, the rule the HTML report checks decompositions with."""
    eps = torch.finfo(torch.float32).eps
    return 4 * eps * max(parts.shape[1], 1) * (parts.abs().sum(1) + total.abs())


def map_condition(method: Any) -> float:
    """How much a method's query map can amplify float32 round-off: the largest condition number
    ``(max eig + damping) / (min eig + damping)`` of its damped curvature blocks for influence methods, 1 for
    methods whose map only scales (or leaves) the query."""
    active = getattr(method, "active", None)
    if not callable(active):
        return 1.0
    curvature = active()
    worst = 1.0
    for name, eig in curvature.blocks.items():
        lam = curvature.block_damping(name)
        low = float(eig.eigenvalues.min()) + lam
        worst = max(worst, (float(eig.eigenvalues.max()) + lam) / low if low > 0 else float("inf"))
    return worst


def decomposition_tolerance(shares: Tensor, totals: Tensor, dim: int, condition: float) -> Tensor:
    """``[P]`` how far per-token shares ``[P, T]`` may sum from their pairs' scores ``[P]`` in float32: the
    summation bound (:func:`sum_tolerance`) plus the round-off of the two ways the parts and the total were
    computed -- dot products over ``dim`` values (``sqrt(dim) * eps``, Higham's probabilistic bound), and for a
    preconditioned query the map applied to the query for the total but to the training row for the parts
    (amplified by the map's ``condition`` number)."""
    eps = torch.finfo(torch.float32).eps
    magnitude = shares.abs().sum(1) + totals.abs()
    return sum_tolerance(shares, totals) + 4 * eps * condition * math.sqrt(max(dim, 1)) * magnitude


def _check_decomposition(side: str, shares: Tensor, totals: Tensor, pairs: PairRows, scores: Scores,
                         hint: str, allowed: Tensor) -> None:
    """Refuse per-token shares ``[P, T]`` that do not sum to the pairs' scores ``[P]`` within ``allowed``
    (``[P]``, :func:`decomposition_tolerance`), naming the first pair."""
    gap = (shares.double().sum(1) - totals.double()).abs()
    bad = gap > allowed
    if bool(bad.any()):
        p = int(bad.nonzero()[0])
        raise ValueError(f"{side} token shares of query {scores.query_ids[int(pairs.queries[p])]!r} and training "
                         f"example {scores.train_ids[int(pairs.train[p])]!r} sum to {float(shares[p].sum()):.6g}, not "
                         f"the pair's score {float(totals[p]):.6g}: {hint}")


def token_shares(token_set: Any, ids: Sequence[str], dense: Tensor, what: str) -> Tensor:
    """``[len(ids), T, F]``: each token of the examples ``ids`` (from a set collected with ``keep_tokens=True``)
    against the ``[F, D]`` vectors ``dense``, one captured batch at a time -- each batch keeps its own token
    layout (a layer used several times per forward lays its uses out per batch length) -- right-padded with
    zeros to the longest batch."""
    from ..grad.batch import vectors_to_batch
    from ..grad.ops import token_inner

    if not getattr(token_set, "batches", None):
        raise ValueError(f"token-level attribution needs the {what}' token-level gradients: collect them with "
                         "keep_tokens=True")
    position = {ident: n for n, ident in enumerate(ids)}
    parts, rows = [], []
    for batch in token_set.batches:
        members = [i for i, ident in enumerate(batch.ids) if ident in position]
        if not members:
            continue
        sub = batch.select(members)
        parts.append(token_inner(sub, vectors_to_batch(dense, sub)))  # [n_b, T_b, F]
        rows += [position[sub.ids[i]] for i in range(len(members))]
    found = set(rows)
    missing = [ident for ident in ids if position[ident] not in found]
    if missing:
        raise ValueError(f"{what} {missing[:3]} are not among the token-level gradients given; collect them with "
                         "keep_tokens=True")
    length = max(p.shape[1] for p in parts)
    out = torch.zeros(len(ids), length, dense.shape[0], dtype=torch.float32)
    for part, index in zip(parts, _split(rows, [p.shape[0] for p in parts])):
        out[torch.tensor(index), :part.shape[1]] = part.to(out.device)
    return out


def _split(rows: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for size in sizes:
        out.append(rows[start:start + size])
        start += size
    return out


def token_attributions(attributor: Any, queries: Any, scores: Scores, *, query_side: bool = True,
                       train_tokens: Any = None, k: int | None = None) -> dict[tuple[str, str], dict[str, Tensor]]:
    """Per-token attribution of the top and bottom ``k`` pairs of every query of ``scores``.

    queries: the query gradients ``scores`` came from; for the query side (``query_side=True``) collected
        with ``keep_tokens=True``: ``score(q, i) = sum_t score(q_t, i)``.
    train_tokens: gradients of (at least) the pairs' training examples collected with ``keep_tokens=True``
        (re-captured for those rows: a store keeps one vector per example), for the training side
        ``score(q, i) = sum_s score(q, i_s)``; None: no training side.

    Returns ``{(query id, train id): {"query": [T_q], "train": [T_i]}}`` over the token positions of each
    example's captured (right-padded) batch; padding positions carry zero. Each side is checked to sum to the
    pair's score kept in ``scores`` (:func:`sum_tolerance`): a re-captured training gradient that does not
    reproduce the stored one (other weights or data options) is an error naming the pair. From a bf16 or int8
    store the re-captured rows are float32, finer than the stored ones: each is checked to round to its stored row
    (:func:`check_reproduces`), and the training side sums to the pair's float32 score ``"train_score"`` (within
    float32 round-off) -- the score a float32 store keeps -- and to the kept, quantized score within
    ``"train_tolerance"``, which adds their gap.

    The query side needs the method's query map ``P`` to be linear and symmetric (grad_dot, influence methods:
    ``<P g_q, x> = sum_t <g_qt, P x>``) or a normalization (grad_cos); the training side needs a training
    transform that scales each example (identity or normalization). Both hold for every one-checkpoint method
    the engine ships; anything else fails the sum check instead of giving wrong shares.
    """
    method = attributor.method
    if len(attributor.train) != 1:
        raise ValueError(f"{method.name} combines checkpoints; token-level attribution takes one checkpoint")
    if not query_side and train_tokens is None:
        raise ValueError("nothing to decompose: query_side=False and no train_tokens")
    attributor.ready()
    source, query_set = attributor.train[0], attributor._query_sets(queries)[0]
    source.spec.check_compatible(query_set.spec, "queries vs training gradients")
    if list(scores.train_ids) != attributor.train_ids:
        raise ValueError("the scores were computed against other training gradients than this attributor's")
    pairs = pair_rows(scores, k)
    unique, inverse = torch.unique(pairs.train, return_inverse=True)  # [U] training rows, [P] into them
    totals = kept_scores(scores, pairs)  # [P]
    raw_queries = query_set.read(0, len(query_set)).to(torch.float32)[_query_positions(query_set.ids, scores)]
    prepared = method.prepare_queries(raw_queries)  # [Q, D]
    normalizes = bool(getattr(type(method), "normalizes", False))
    condition = map_condition(method)
    out: dict[tuple[str, str], dict[str, Tensor]] = {
        (scores.query_ids[q], scores.train_ids[t]): {} for q, t in zip(pairs.queries.tolist(), pairs.train.tolist())}
    if query_side:
        prepared_rows = method.prepare_train(read_rows(source, unique))  # [U, D]
        # <P g_q, y> = sum_t <g_qt, P y> for a symmetric linear P; a normalization divides by |g_q| instead
        right = prepared_rows if normalizes else method.prepare_queries(prepared_rows)
        shares = token_shares(query_set, list(scores.query_ids), right, "queries")  # [Q, T_q, U]
        if normalizes:
            shares = shares / raw_queries.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
        per_pair = shares[pairs.queries, :, inverse]  # [P, T_q]
        allowed = decomposition_tolerance(per_pair.double(), totals.double(), attributor.spec.dim, condition)
        _check_decomposition("query-side", per_pair, totals, pairs, scores,
                             f"{method.name}'s query map is not linear and symmetric, or these are not the query "
                             "gradients the scores came from", allowed)
        for key, row, tol in zip(out, per_pair, allowed.tolist()):
            out[key]["query"] = row
            out[key]["query_tolerance"] = tol
    if train_tokens is not None:
        source.spec.check_compatible(train_tokens.spec, "token-level training gradients vs the training gradients")
        ids = [scores.train_ids[t] for t in unique.tolist()]
        recaptured = train_tokens.read(0, len(train_tokens)).to(torch.float32)[train_tokens.index_of(ids)]  # [U, D]
        shares = token_shares(train_tokens, ids, prepared, "training examples")  # [U, T_i, Q]
        plain = recaptured @ prepared.t()  # [U, Q]; the training transform scales each example:
        scaled = method.prepare_train(recaptured) @ prepared.t()
        nonzero = plain != 0
        factor = torch.where(nonzero, scaled / plain.where(nonzero, torch.ones_like(plain)), torch.zeros_like(plain))
        per_pair = shares[inverse, :, pairs.queries] * factor[inverse, pairs.queries].unsqueeze(1)  # [P, T_i]
        quantized = source.spec.dtype != "float32"
        if quantized:  # the shares sum to the float32 score of the re-captured row, not to the quantized one's
            check_reproduces(recaptured, read_rows(source, unique), source.spec.dtype, ids)
            own = scaled[inverse, pairs.queries]  # [P]
        else:
            own = totals
        allowed = decomposition_tolerance(per_pair.double(), own.double(), attributor.spec.dim, 1.0)
        _check_decomposition("training-side", per_pair, own, pairs, scores,
                             "the re-captured gradient does not reproduce the stored one (other weights or data "
                             "options)", allowed)
        # how far the shares may sum from the kept score: the float32 bound, plus (bf16/int8) the kept score's own
        # quantization gap, within the store's precision by check_reproduces
        kept_gap = (own.double() - totals.double()).abs() if quantized else torch.zeros_like(allowed)
        for key, row, tol, score, gap in zip(out, per_pair, allowed.tolist(), own.tolist(), kept_gap.tolist()):
            out[key]["train"] = row
            out[key]["train_tolerance"] = tol + gap
            if quantized:
                out[key]["train_score"] = score
    return out


def check_reproduces(recaptured: Tensor, stored: Tensor, dtype: str, ids: Sequence[str]) -> None:
    """Refuse re-captured float32 rows ``[U, D]`` that differ from the ``stored`` rows (``[U, D]``, as read back
    from a ``"bfloat16"`` or ``"int8"`` store) by more than rounding to the store's precision allows.

    Rounding a value ``x`` to the store moves it by at most half a step: int8 by ``h / 2``, ``h`` the row's scale,
    ``max |x_row| / 127`` (= ``max |stored row| / 127``: the largest value maps to +-127 exactly); bfloat16 by
    ``u |stored|``, ``u = 2**-8`` (8 significant bits, round to nearest). Re-capturing in other batches (other
    padding) adds float32 round-off, allowed as ``4 eps32 sqrt(D) max |x_row|`` per value (measured: 2e-7 of the
    row's largest value on the test GPT-2, 30 x below it). Other weights or data options change gradients by far
    more, and are refused naming the first example."""
    eps = torch.finfo(torch.float32).eps
    peak = stored.abs().amax(dim=1, keepdim=True)  # [U, 1]
    if dtype == "int8":
        step = (peak / 127.0 / 2.0).expand_as(stored)
    else:
        step = torch.finfo(torch.bfloat16).eps / 2 * stored.abs()
    allowed = step + 4 * eps * math.sqrt(max(stored.shape[1], 1)) * peak + torch.finfo(torch.float32).tiny
    excess = (recaptured - stored).abs() - allowed  # [U, D]
    bad = (excess > 0).any(dim=1)
    if bool(bad.any()):
        u = int(bad.nonzero()[0])
        gap = float((recaptured[u] - stored[u]).abs().max())
        raise ValueError(f"the re-captured gradient of training example {ids[u]!r} differs from the stored one by up "
                         f"to {gap:.3g}, more than rounding to the store's {dtype} allows (largest value "
                         f"{float(peak[u]):.3g}): the store was collected with other weights or data options")


def kept_scores(scores: Scores, pairs: PairRows) -> Tensor:
    """``[P]`` the pairs' scores as kept in ``scores`` (the matrix, else the top/bottom-k they came from)."""
    if scores.matrix is not None:
        return scores.matrix[pairs.queries, pairs.train]
    sides = [kept for kept in (scores.top, scores.bottom) if kept is not None]
    values = torch.cat([side[0] for side in sides], dim=1)[pairs.queries]  # [P, 2k] ([P, k]: top-k only)
    indices = torch.cat([side[1] for side in sides], dim=1)[pairs.queries]
    first = (indices == pairs.train.unsqueeze(1)).to(torch.int8).argmax(1, keepdim=True)  # pairs come from them
    return values.gather(1, first).squeeze(1)


def token_records(shares: dict[tuple[str, str], dict[str, Tensor]],
                  tokens: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """``Scores.meta["tokens"]`` records (``docs/report.md``) of :func:`token_attributions`' shares.

    tokens: each example's tokens as strings (query and training ids), in order; each side's shares are cut to
    that many positions (batches are right-padded: the rest is padding, zero). None: positions as labels.
    """
    records = []
    for (qid, tid), sides in shares.items():
        record: dict[str, Any] = {"query_id": qid, "train_id": tid}
        for side, ident in (("query", qid), ("train", tid)):
            if side not in sides:
                continue
            if f"{side}_tolerance" in sides:  # how far the shares may sum from the score (float32 round-off)
                record[f"{side}_tolerance"] = float(sides[f"{side}_tolerance"])
            if f"{side}_score" in sides:  # a bf16/int8 store: the float32 score the re-captured shares sum to
                record[f"{side}_score"] = float(sides[f"{side}_score"])
            values = sides[side]
            if tokens is not None:
                if ident not in tokens:
                    raise ValueError(f"no tokens given for {side} example {ident!r}")
                names = list(tokens[ident])
                if len(names) > values.numel():
                    raise ValueError(f"{side} example {ident!r}: {len(names)} tokens but {values.numel()} token "
                                     "positions were captured; pass the tokens it was collected with")
                values = values[:len(names)]
            else:
                names = [str(t) for t in range(values.numel())]
            record[f"{side}_tokens"], record[f"{side}_scores"] = names, values.tolist()
        records.append(record)
    return records
