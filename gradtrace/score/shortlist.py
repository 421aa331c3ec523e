"""Scoring through an index: an approximate shortlist per query, then exact re-scoring from the store.

``score_with_index(attributor, queries, index, SearchOptions(rerank=R))`` is the large-store counterpart of
``attributor.score(queries)`` (:class:`gradtrace.options.index.SearchOptions` holds its settings):

1. the method prepares the queries exactly as the engine does (:meth:`Method.prepare_queries`: for influence
   methods the inverse curvature is applied here, to the query side only);
2. the index returns the ``R`` rows of highest approximate inner product with each prepared query (and,
   for the bottom-k, with its negation); a query whose visited IVF cells hold fewer than ``k`` rows is searched
   again with more cells (:func:`search_enough`; counted in ``meta["index"]["widened"]``);
3. the candidate rows are read from the store (:meth:`GradientStore.rows`, in row order, into a reused buffer)
   and scored exactly (``prepared_query @ prepare_train(rows)^T``, :func:`rerank_exact`), and the top-k of the
   exact scores is kept;
4. with ``norm_rows=N``, the ``N`` rows of largest norm (``Index.row_norms``) join every query's candidates, for
   the top and the bottom: they are scored once against all queries (one ``[Q, N]`` product,
   :func:`score_norm_rows`) and merged with each query's re-scored candidates (a row in both counts once). Large
   rows reach the extreme scores in both directions, and the bottom-k's are scattered over cells that a search
   with the negated query does not visit (see :mod:`gradtrace.score.row_norms`).

Every reported score is therefore exact; only the membership of the top-k is approximate (recall@k of the
index path). With ``R >= rows`` and a flat index the result equals exact streaming scoring.

Training rows enter the score raw (``grad_dot``, ``kfac``, ``ekfac``, ``ggn``, ``logra``) or normalized
(``grad_cos``, which needs an index built with ``normalize=True``); methods that transform training rows
otherwise, or combine checkpoints, cannot be served by one index and are refused.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..capture.gradient_set import as_source
from ..fit.methods import Method
from ..options.base import option_object
from ..options.index import SearchOptions
from .engine import _block_buffer, rows_product
from .index import Index, IndexMismatch
from .parallel import chunk_workers, map_chunks
from .row_norms import largest_norm_rows
from .scores import Scores

__all__ = ["NormRows", "check_norm_rows", "index_normalization", "rerank_exact", "score_norm_rows", "score_with_index",
           "search_enough"]


class NormRows:
    """The rows every query shares (the ``N`` of largest norm) and their best exact scores per query.

    Attributes: ``member`` (bool ``[rows]``: whether a store row is one of them), and per side (``"top"``,
    ``"bottom"``) ``(values [Q, k'], rows [Q, k'])``: each query's ``k' = min(k, N)`` highest or lowest exact
    scores among them. The top-k of a query's candidates together with these rows is the top-k of its
    candidates outside them merged with these ``k'``: any other shared row has ``k'`` shared rows above it.
    """

    def __init__(self, member: Tensor, extremes: dict[str, tuple[Tensor, Tensor]]) -> None:
        self.member = member
        self.extremes = extremes


def index_normalization(method: Method) -> bool:
    """Whether ``method`` needs an index of normalized rows (True) or of raw rows (False).

    Raises ValueError for methods whose training side no single index can serve: multi-checkpoint methods
    and methods with another per-row transform.
    """
    if method.multi_checkpoint:
        raise ValueError(f"{method.name} combines several checkpoints; an index serves one store: score it "
                         "without --index")
    if getattr(type(method), "normalizes", False):
        return True
    if type(method).prepare_train is not Method.prepare_train:
        raise ValueError(f"{method.name} transforms the training rows before scoring; an index of stored rows "
                         "cannot shortlist for it: score it without --index")
    return False


def score_norm_rows(attributor: Any, store: Any, prepared: Tensor, norms: Tensor, n: int, k: int, *,
                    bottom: bool = True, chunk_rows: int = 8192) -> NormRows:
    """Exact scores of the ``n`` rows of largest norm against every query, once: one ``[Q, n]`` product.

    The rows are read in row order, ``chunk_rows`` at a time, and decoded into a reused buffer by
    :func:`gradtrace.score.engine.rows_product` (the path of :func:`rerank_exact`); on the CPU with several torch
    threads the chunks run on one-thread workers as in :func:`rerank_exact` (same result for any number). Each
    query keeps its ``min(k, n)`` highest (and, with ``bottom``, lowest) scores among them (:class:`NormRows`).
    """
    rows = largest_norm_rows(norms, n)  # [n], increasing
    wanted = rows.numpy()
    work = partial(_norm_rows_part, attributor.method, store, prepared, wanted, chunk_rows)
    scratch = partial(_block_buffer, [store], chunk_rows, prepared.device)
    parts = map_chunks(range(0, len(wanted), chunk_rows), work, scratch, chunk_workers(prepared.device))
    scores = torch.cat(parts, dim=1)  # [Q, n]
    member = torch.zeros(len(norms), dtype=torch.bool)
    member[rows] = True
    extremes = {}
    for name, largest in (("top", True), ("bottom", False))[:2 if bottom else 1]:
        values, position = torch.topk(scores, min(k, len(wanted)), dim=1, largest=largest)
        extremes[name] = (values, rows[position])
    return NormRows(member, extremes)


def _norm_rows_part(method: Method, store: Any, prepared: Tensor, wanted: Any, chunk_rows: int, lo: int,
                    buffer: tuple[Tensor, Tensor]) -> Tensor:
    """``[Q, c]`` exact scores of the shared rows ``wanted[lo:lo + chunk_rows]`` against every query (on the CPU),
    decoded into ``buffer`` (the caller's worker's)."""
    part = wanted[lo:lo + chunk_rows]
    return rows_product(prepared, store, len(part), lambda a, b, out, scales: store.rows(
        part[a:b], out=out, scales=scales), method, 0, buffer).cpu()


def rerank_exact(attributor: Any, store: Any, prepared: Tensor, candidates: Tensor, k: int, *,
                 largest: bool = True, chunk_rows: int = 8192,
                 shared: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Exact top-``k`` among each query's candidate rows.

    Queries are taken in chunks of about ``chunk_rows / R``: the chunk's candidate rows are gathered from the
    store's memory map once (deduplicated, in row order) into one reused buffer and scored against the chunk's
    queries with :func:`gradtrace.score.engine.rows_product` (int8 scales applied to the scores for methods that
    score raw rows); each query keeps the scores of its own candidates. A chunk decodes about ``chunk_rows``
    rows and computes ``chunk`` times the dot products its queries need (every query against all its rows): few,
    large operations (cheap on a shared machine, where every operation's fork-join waits for a busy core), and no
    fresh ``[rows, dim]`` tensor per chunk (its page faults cost more than the decoding).

    On the CPU with ``W = torch.get_num_threads() > 1`` the chunks run on ``W`` worker threads
    (:func:`gradtrace.score.parallel.map_chunks`), each with one intra-op thread and its own decode buffer of
    :data:`gradtrace.score.engine.SUB_BLOCK_BYTES` sub-blocks (as the sequential path with one thread): a
    chunk's small memory-bound operations then run whole on one core instead of forking and joining every
    thread for each. Each chunk's arithmetic is the same whatever ``W`` (same sub-blocks, same product shapes,
    one thread), so the result is identical for any ``W``; the caller's thread count is left unchanged, and
    an error in a chunk is raised unchanged. A CUDA device takes the chunks in order.

    Args:
        attributor: supplies the method (``prepare_train``).
        store: the store the candidates index (global row numbers).
        prepared: ``[Q, dim]`` prepared queries (on ``attributor.device``).
        candidates: ``[Q, R]`` int64 store rows per query; ``-1`` marks no candidate.
        k: rows kept per query (each query needs at least ``k`` candidates).
        largest: keep the highest (True) or lowest scores.
        chunk_rows: candidate rows per chunk of queries (the decode buffer's rows).
        shared: ``(member [rows] bool, values [Q, s], rows [Q, s])``: rows scored already for every query
            (:class:`NormRows`: their best ``s`` per query), merged in; candidates that are members are dropped
            from the candidates first, so that no row is kept twice.
    Returns:
        ``(values [Q, k], rows [Q, k])`` on the CPU, best first.
    """
    valid = candidates >= 0
    short = (valid.sum(dim=1) < k).nonzero().flatten()
    if len(short):
        q = int(short[0])
        raise ValueError(f"the index returned {int(valid[q].sum())} candidates for query {q}, fewer than k={k}: "
                         "search more IVF cells (nprobe) or raise rerank")
    num_q, r = candidates.shape
    chunk = max(1, chunk_rows // r)
    work = partial(_rerank_chunk, attributor.method, store, prepared, candidates, valid, k, largest, chunk, shared)
    scratch = partial(_block_buffer, [store], chunk * r, prepared.device)
    kept = map_chunks(range(0, num_q, chunk), work, scratch, chunk_workers(prepared.device))
    return torch.cat([values for values, _ in kept]), torch.cat([rows for _, rows in kept])


def _rerank_chunk(method: Method, store: Any, prepared: Tensor, candidates: Tensor, valid: Tensor, k: int,
                  largest: bool, chunk: int, shared: tuple[Tensor, Tensor, Tensor] | None, lo: int,
                  buffer: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``(values [c, k], rows [c, k])``: the exact top-``k`` of queries ``lo:lo + chunk`` among their candidates
    (:func:`rerank_exact`'s arguments), their deduplicated rows decoded into ``buffer`` (the caller's worker's)."""
    fill = float("-inf") if largest else float("inf")
    cand = candidates[lo:lo + chunk]
    unique, inverse = torch.unique(cand.clamp(min=0), sorted=True, return_inverse=True)
    wanted = unique.numpy()
    scores = rows_product(prepared[lo:lo + chunk], store, len(wanted), lambda a, b, out, scales: store.rows(
        wanted[a:b], out=out, scales=scales), method, 0, buffer).cpu()  # [chunk, unique]
    exact = scores.gather(1, inverse)  # [chunk, R]: query i, its candidates
    exact.masked_fill_(~valid[lo:lo + chunk], fill)
    if shared is not None:  # drop candidates among the shared rows, then append each query's shared best
        member, shared_values, shared_rows = shared
        exact.masked_fill_(member[cand.clamp(min=0)], fill)
        exact = torch.cat([exact, shared_values[lo:lo + chunk]], dim=1)
        cand = torch.cat([cand, shared_rows[lo:lo + chunk]], dim=1)
    top, position = torch.topk(exact, k, dim=1, largest=largest)
    return top, cand.gather(1, position)


def search_enough(index: Index, vectors: Tensor, r: int, k: int, nprobe: int | None = None
                  ) -> tuple[Tensor, int]:
    """``[Q, r]`` candidate rows per query from ``index``, each query with at least ``k`` candidates.

    An IVF search returns fewer than ``r`` rows when the ``nprobe`` cells it visits hold fewer; the queries
    left with fewer than ``k`` are searched again with twice the cells, up to all of them (then every row is
    a candidate). Returns the candidates (``-1`` pads) and how many queries needed more cells.
    """
    _, rows = index.search(vectors, r, nprobe=nprobe)
    probe = nprobe or index.params.nprobe or 1
    nlist = index.params.nlist or 1
    widened: set[int] = set()
    short = ((rows >= 0).sum(dim=1) < k).nonzero().flatten()
    while len(short) and index.params.kind == "ivfpq" and probe < nlist:
        widened.update(short.tolist())
        probe = min(2 * probe, nlist)
        _, again = index.search(vectors[short], r, nprobe=probe)
        rows[short] = again
        short = short[(again >= 0).sum(dim=1) < k]
    return rows, len(widened)


def score_with_index(attributor: Any, queries: Any, index: Index | str, options: SearchOptions | None = None
                     ) -> Scores:
    """Top-k scores of ``queries`` from an index shortlist per query, re-scored exactly from the store.

    Args:
        attributor: a single-checkpoint :class:`gradtrace.Attributor` over a :class:`gradtrace.GradientStore`.
        queries: query gradients (as for :meth:`Attributor.score`).
        index: an :class:`Index` of that store (or its path); refused when the store changed since it was
            built, when it indexes another store, or when its normalization does not fit the method.
        options: how the index is searched and what is kept (:class:`gradtrace.options.index.SearchOptions`:
            ``topk``, ``rerank`` shortlist rows, ``bottom``, ``nprobe`` / ``bottom_nprobe`` IVF cells and the
            ``norm_rows`` shared by every query; default ``SearchOptions()``). A query whose visited cells hold
            fewer than ``topk`` rows is searched again with more (:func:`search_enough`). The ``norm_rows`` rows
            of largest norm are scored once against all queries (one ``[Q, N]`` product: about ``N / rows`` of an
            exact pass); they need an index that records row norms (an older one: ``gradtrace index STORE --out
            INDEX --add-norms``) and are refused with a normalized index (``grad_cos``: every row has norm 1).
    Returns:
        :class:`Scores` with ``top``/``bottom`` (no matrix; no bottom with ``bottom=False``), in the store's row
        numbering; ``meta["index"]`` records the index, the shortlist size, the cells searched and ``norm_rows``
        (the rows shared, at most the store's).
    Raises:
        TypeError: ``options`` is not a ``SearchOptions``.
        IndexMismatch: the index does not belong to the store or cannot serve the method or ``norm_rows``.
        ValueError: a method no index can serve, a ``rerank`` below ``topk``, ``nprobe`` for a flat index, or queries
            with NaN/inf values.
    """
    from ..store import GradientStore

    options = option_object(options, SearchOptions, "options")
    topk, rerank, bottom, norm_rows = options.topk, options.rerank, options.bottom, options.norm_rows
    nprobe, bottom_nprobe = options.nprobe, options.bottom_nprobe
    if isinstance(index, (str, bytes)) or hasattr(index, "__fspath__"):
        index = Index.load(index)
    if (nprobe is not None or bottom_nprobe is not None) and index.params.kind != "ivfpq":
        raise ValueError(f"nprobe / bottom_nprobe choose the IVF cells an IVF-PQ search visits; {index.path or 'this'} "
                         f"is a {index.params.kind} index (exact: it searches every row): leave them unset")
    method = attributor.method
    normalized = index_normalization(method)
    store = attributor.train[0]
    if not isinstance(store, GradientStore):
        raise ValueError("scoring through an index re-reads the shortlisted rows from a GradientStore; the "
                         f"training gradients here are a {type(store).__name__}")
    if normalized != index.normalized:
        built = "normalized rows (for grad_cos)" if index.normalized else "raw rows"
        need = "normalized rows: build it with normalize=True (--normalize)" if normalized else \
            "raw rows: build it without normalize (--normalize is for grad_cos)"
        where = index.path or "the index"
        raise IndexMismatch(f"{where} holds {built}; {method.name} needs an index of {need}")
    check_norm_rows(index, norm_rows)
    attributor.ready()
    index.check_store(store)
    start = time.perf_counter()
    query_set = as_source(queries)
    store.spec.check_compatible(query_set.spec, "queries vs training gradients")
    if len(query_set) == 0:
        raise ValueError("no query gradients")
    prepared = method.prepare_queries(query_set.read(0, len(query_set), attributor.device).to(torch.float32))
    finite = torch.isfinite(prepared).all(dim=1).cpu()
    if not bool(finite.all()):
        bad = [query_set.ids[i] for i in (~finite).nonzero().flatten().tolist()]
        raise ValueError(f"query {bad[0]!r} ({len(bad)} in all) has NaN/inf values in its prepared gradient; "
                         "recompute it (a NaN loss, or a singular curvature: raise the damping)")
    num_train = len(store)
    k = min(topk, num_train)
    shortlist = min(rerank if rerank is not None else 10 * k, num_train)
    if shortlist < k:
        raise ValueError(f"rerank={rerank} is smaller than topk={k}: the shortlist must hold at least k rows")
    profile = {"prepare_queries_s": time.perf_counter() - start}
    kept: dict[str, tuple[Tensor, Tensor]] = {}
    widened: dict[str, int] = {}
    shared = None
    if norm_rows:
        scored = time.perf_counter()
        shared = score_norm_rows(attributor, store, prepared, index.row_norms, norm_rows, k, bottom=bottom)
        profile["norm_rows_s"] = time.perf_counter() - scored
    for name, sign, largest in (("top", 1.0, True), ("bottom", -1.0, False))[:2 if bottom else 1]:
        searched = time.perf_counter()
        probe = (bottom_nprobe or nprobe) if name == "bottom" else nprobe
        candidates, widened[name] = search_enough(index, prepared.cpu() * sign, shortlist, k, probe)
        profile[f"search_{name}_s"] = time.perf_counter() - searched
        reranked = time.perf_counter()
        kept[name] = rerank_exact(attributor, store, prepared, candidates, k, largest=largest,
                                  shared=None if shared is None else (shared.member, *shared.extremes[name]))
        profile[f"rerank_{name}_s"] = time.perf_counter() - reranked
    profile["total_s"] = time.perf_counter() - start
    attributor.profile.update(profile)
    meta = {"method": method.name, "options": method.options(), "spec": {
        "projection": store.spec.projection, "convention": store.spec.convention, "dim": store.spec.dim,
        "model": store.spec.model}, "checkpoints": 1, "profile": profile,
        "index": {"path": str(index.path) if index.path else None, "kind": index.params.kind,
                  "factory": index.params.factory(), "normalize": index.params.normalize,
                  "nprobe": nprobe or index.params.nprobe, "rerank": shortlist,
                  "bottom_nprobe": (bottom_nprobe or nprobe or index.params.nprobe) if bottom else None,
                  "norm_rows": min(norm_rows, num_train), "widened": widened,
                  "store_digest": index.fingerprint.get("digest")}}
    return Scores(train_ids=list(store.ids), query_ids=list(query_set.ids), method=method.name, top=kept["top"],
                  bottom=kept.get("bottom"), meta=meta)


def check_norm_rows(index: Index, norm_rows: int) -> None:
    """Refuse a ``norm_rows`` that ``index`` cannot serve: negative, a normalized index, an index without norms."""
    if isinstance(norm_rows, bool) or not isinstance(norm_rows, int) or norm_rows < 0:
        raise ValueError(f"norm_rows must be an integer >= 0 (0: no norm shortlist), got {norm_rows!r}")
    if not norm_rows:
        return
    where = index.path or "the index"
    if index.normalized:
        raise IndexMismatch(f"{where} holds normalized rows (grad_cos): every row has norm 1, so the rows of largest "
                            "norm mean nothing there; drop norm_rows (--norm-rows)")
    if index.row_norms is None:
        raise IndexMismatch(f"{where} records no row norms (built before they were); add them without a rebuild: "
                            f"gradtrace index {index.meta.get('store', 'STORE')} --out {index.path or 'INDEX'} "
                            "--add-norms")
