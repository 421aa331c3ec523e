"""The scoring engine: ``Attributor(method, train).score(queries) -> Scores``.

Training gradients stay raw in the store; queries are few. So a method transforms the query side once
(:meth:`Method.prepare_queries`) and scoring streams the training rows in blocks: one matrix product per
block (per checkpoint for multi-checkpoint methods), a streaming top-k merge, and the full ``[Q, N]``
matrix only when it fits the memory budget. Peak memory is ``O(Q * (block + k) + block * D)`` whatever
the number of training examples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..capture.gradient_set import as_source
from ..common.checks import count as checked_count
from ..common.units import block_rows_for
from ..fit.methods import Method, get_method
from ..grad import GradientBatch
from ..store.spec import GradientSpec
from .agreement import MemberTops
from .distribution import ScoreDistribution
from .scores import Scores, scoring_meta

__all__ = ["Attributor", "ScoringError"]


class ScoringError(ValueError):
    """Scoring produced values that cannot be trusted (NaN/inf), with the queries and training rows named."""


def _merge(kept: tuple[Tensor, Tensor] | None, block: Tensor, offset: int, k: int,
           largest: bool) -> tuple[Tensor, Tensor]:
    """Merge a ``[Q, n]`` block of scores into the running top-k ``(values, indices)``."""
    take = min(k, block.shape[1])
    values, local = torch.topk(block, take, dim=1, largest=largest)
    indices = local + offset
    if kept is not None:
        values = torch.cat([kept[0], values], dim=1)
        indices = torch.cat([kept[1], indices], dim=1)
        values, order = torch.topk(values, min(k, values.shape[1]), dim=1, largest=largest)
        indices = torch.gather(indices, 1, order)
    return values, indices


def is_member_list(train: Any) -> bool:
    """Whether ``train`` is a list of gradient sources (stores, paths, gradient sets, lists of batches), one per
    checkpoint or model -- not a list of captured :class:`GradientBatch` es, which is one source."""
    if not isinstance(train, (list, tuple)) or not train:
        return False
    return not all(isinstance(item, GradientBatch) for item in train)


class Attributor:
    """Scores query gradients against training gradients with an attribution method.

    Args:
        method: a registered method name (``"grad_dot"``, ``"grad_cos"``, ``"tracin"``, ...) or instance.
        train: training gradients -- a :class:`gradtrace.GradientStore`, its path, a
            :class:`gradtrace.GradientSet` or captured batches; for multi-checkpoint methods a list with
            one per checkpoint (same examples); for any other method a list is refused (an ensemble is
            :class:`gradtrace.Ensemble`).
        block_rows: training rows per streamed block (default: as many as fit in
            :data:`gradtrace.common.units.BLOCK_BYTES`, 128 MiB of float32: 8,192 rows of 4,096 dims; the decode
            buffer and each block's products are bounded by it whatever the store's length).
        device: where the products run (default: CPU; blocks are moved there as they stream).
        matrix_bytes: keep the full ``[Q, N]`` matrix when it takes at most this many bytes.
        score_dtype: ``"float32"`` or ``"float64"``: the dtype of the query x train products in :meth:`score` and
            of the scores it returns (the prepared queries and decoded rows are cast to it; recorded in
            ``Scores.meta``).
        **method_options: passed to the method (e.g. ``weights=[...]`` learning rates for TracIn).
    """

    prefetch: bool | None = None
    """Read the next block of a gradient store on a thread while the current one is scored (into pinned buffers,
    copied with ``non_blocking`` for a CUDA ``device``; see :mod:`gradtrace.store.prefetch`); the scores are
    bit-identical either way. None (auto): on a CUDA device, or on the CPU with several torch threads -- with one,
    decoding in place sub-block by sub-block keeps the rows in cache and is faster (``bench/d2h.py``). Set it on an
    instance to choose; prefetching holds two decoded blocks (2 x 128 MiB by default)."""

    def __init__(self, method: str | Method = "grad_dot", train: Any = None, *, block_rows: int | None = None,
                 device: torch.device | str | None = None, matrix_bytes: int = 2**30, score_dtype: str = "float32",
                 **method_options: Any) -> None:
        if score_dtype not in ("float32", "float64"):
            raise ValueError(f"score_dtype must be one of ('float32', 'float64'), got {score_dtype!r}")
        self.score_dtype = score_dtype
        if isinstance(method, (list, tuple)):
            raise ValueError("Attributor takes one method; an ensemble of methods or models is "
                             "gradtrace.Ensemble(methods, [train_1, ...])")
        self.method = get_method(method, **method_options)
        if train is None:
            raise ValueError("Attributor needs training gradients: train=store, path, GradientSet or batches")
        if is_member_list(train) and not self.method.multi_checkpoint:
            raise ValueError(f"Attributor({self.method.name!r}, [...]) got {len(train)} training sources, but "
                             f"{self.method.name} scores one model: an ensemble of checkpoints or models is "
                             f"gradtrace.Ensemble({self.method.name!r}, [train_1, ...])")
        sources = list(train) if isinstance(train, (list, tuple)) and self.method.multi_checkpoint else [train]
        self.train = [as_source(s) for s in sources]
        self.block_rows = block_rows_for(self.train[0].spec.dim) if block_rows is None else \
            _positive_int(block_rows, "block_rows", minimum=1)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.matrix_bytes = _positive_int(matrix_bytes, "matrix_bytes", minimum=0)
        first = self.train[0]
        for c, other in enumerate(self.train[1:], start=1):
            if list(other.ids) != list(first.ids):
                raise ValueError(f"checkpoint {c}'s training gradients hold different examples (or order) than "
                                 "checkpoint 0's; collect them over the same data")
            if [n for n, _ in other.spec.params] != [n for n, _ in first.spec.params]:
                raise ValueError(f"checkpoint {c}'s training gradients cover different parameters")
        self.profile: dict[str, float] = {}

    @property
    def spec(self) -> GradientSpec:
        return self.train[0].spec

    @property
    def train_ids(self) -> list[str]:
        return list(self.train[0].ids)

    def fit(self, *args: Any, **kwargs: Any) -> Attributor:
        """Fit what the method needs (curvature, optimizer states); a no-op for methods that need nothing."""
        self.method.fit(self, *args, **kwargs)
        return self

    def ready(self) -> list[float]:
        """Check that the method's stages were run, bind it to the training gradients' spec, and return the
        weight of each checkpoint (what every scoring path does first)."""
        self.method.check_ready()
        self.method.bind(self.spec)
        return self.method.checkpoint_weights(len(self.train))

    def _query_sets(self, queries: Any) -> list[Any]:
        if self.method.multi_checkpoint:
            if not isinstance(queries, (list, tuple)) or len(queries) != len(self.train):
                raise ValueError(f"{self.method.name} scores queries at every checkpoint: pass a list of "
                                 f"{len(self.train)} query gradient sets, one per training checkpoint")
            return [as_source(q) for q in queries]
        return [as_source(queries)]

    def _keep_matrix(self, num_queries: int, num_train: int, topk: int | None, matrix: bool | str) -> bool:
        """Whether to keep the full ``[Q, N]`` matrix (``matrix="auto"``: when it fits ``matrix_bytes``); refuses
        empty inputs and a request that would keep nothing."""
        if num_train == 0:
            raise ValueError("the training gradients are empty")
        if num_queries == 0:
            raise ValueError("no query gradients")
        if topk is not None:
            _positive_int(topk, "topk", minimum=0)
        if matrix not in (True, False, "auto"):
            raise ValueError(f"matrix must be True, False or 'auto', got {matrix!r}")
        keep = (num_queries * num_train * 4 <= self.matrix_bytes) if matrix == "auto" else bool(matrix)
        if not keep and not topk:
            raise ValueError("neither the matrix nor a top-k would be kept: pass topk=k or matrix=True")
        return keep

    def score(self, queries: Any, *, topk: int | None = 100, matrix: bool | str = "auto",
              progress: bool = False) -> Scores:
        """Score every query against every training example.

        Args:
            queries: query gradients (same kinds as ``train``; one per checkpoint for multi-checkpoint methods).
            topk: keep the ``topk`` highest and lowest scores of each query while streaming (None: none).
            matrix: keep the full ``[Q, N]`` matrix: True, False or ``"auto"`` (when it fits ``matrix_bytes``).
            progress: show a progress bar over training blocks.
        """
        weights = self.ready()
        start = time.perf_counter()
        query_sets = self._query_sets(queries)
        prepared = []
        for c, (q, t) in enumerate(zip(query_sets, self.train)):
            t.spec.check_compatible(q.spec, f"queries vs training gradients (checkpoint {c})")
            if list(q.ids) != list(query_sets[0].ids):
                raise ValueError(f"checkpoint {c}'s queries differ from checkpoint 0's")
            prepared.append(self.method.prepare_queries(q.read(0, len(q), self.device).to(torch.float32), c).to(
                getattr(torch, self.score_dtype)))
            _check_prepared(prepared[-1], q.ids, self.method.name, c)
        self.profile["prepare_queries_s"] = time.perf_counter() - start
        num_q, num_train = len(query_sets[0]), len(self.train[0])
        keep_matrix = self._keep_matrix(num_q, num_train, topk, matrix)
        full = torch.empty(num_q, num_train, dtype=prepared[0].dtype, device=self.device) if keep_matrix else None
        top = bottom = None
        distribution = ScoreDistribution(num_q, self.device)
        members = MemberTops(len(self.train)) if len(self.train) > 1 else None  # do the checkpoints agree?
        blocks = range(0, num_train, self.block_rows)
        bar = _bar(blocks, progress, num_train, self.block_rows)
        stream = time.perf_counter()
        buffer = _block_buffer(self.train, self.block_rows, self.device)
        ahead = _prefetcher(self, blocks, num_train) if buffer is not None else None
        try:
            for offset in blocks:
                stop = min(num_train, offset + self.block_rows)
                scores = None
                for c, source in enumerate(self.train):
                    block = ahead.next() if ahead is not None and _is_store(source) else None
                    part = _block_product(prepared[c], source, offset, stop, self.method, c, buffer, block)
                    if members is not None:
                        members.add(c, part, offset)
                    scores = part.mul_(weights[c]) if scores is None else scores.add_(part, alpha=weights[c])
                _check_block(scores, query_sets[0].ids, self.train[0].ids, offset, self.method.name)
                distribution.add(scores)
                if full is not None:
                    full[:, offset:stop] = scores
                if topk:
                    top = _merge(top, scores, offset, topk, largest=True)
                    bottom = _merge(bottom, scores, offset, topk, largest=False)
                _advance(bar, stop - offset, offset // self.block_rows + 1, len(blocks))
        finally:
            _close(bar, ahead)
        self.profile["stream_s"] = time.perf_counter() - stream
        self.profile["rows_per_s"] = num_train / max(self.profile["stream_s"], 1e-9)
        meta = scoring_meta(self.method, self.spec, weights=weights, topk=topk, matrix=keep_matrix,
                            block_rows=self.block_rows, device=self.device, profile=self.profile,
                            score_dtype=self.score_dtype)
        meta["distribution"] = distribution.meta()
        coverage = _recorded_coverage(self.train[0])
        if coverage is not None:  # the share of the model the training rows cover (the report shows it)
            meta["coverage"] = coverage
        if members is not None:
            meta["agreement"] = members.meta(top[1] if top is not None else None)
        cpu = lambda kept: None if kept is None else (kept[0].cpu(), kept[1].cpu())
        return Scores(train_ids=self.train_ids, query_ids=list(query_sets[0].ids), method=self.method.name,
                      matrix=full.cpu() if full is not None else None, top=cpu(top), bottom=cpu(bottom), meta=meta)

    def token_scores(self, queries: Any, train_ids: Sequence[str], query_ids: Sequence[str] | None = None
                     ) -> dict[tuple[str, str], Tensor]:
        """Per-token shares of scores: ``{(query id, train id): [T]}`` summing to the pair's score.

        Needs training gradients kept with their tokens (``collect(..., options=CaptureOptions(keep_tokens=True))``
        or captured batches) and a method whose training-side transform is a per-example scaling (dot, cosine, TracIn
        at one checkpoint).
        """
        from .pairs import token_shares as _token_shares

        if len(self.train) != 1:
            raise ValueError("per-token scores are computed for one checkpoint at a time")
        train = self.train[0]
        if not hasattr(train, "token_batch"):
            raise ValueError("per-token scores need in-memory training gradients with tokens "
                             "(collect(..., options=CaptureOptions(keep_tokens=True))); stores keep one vector per "
                             "example")
        query_set = self._query_sets(queries)[0]
        train.spec.check_compatible(query_set.spec, "queries vs training gradients")
        rows = train.index_of(train_ids)
        qrows = list(range(len(query_set))) if query_ids is None else query_set.index_of(query_ids)
        q = self.method.prepare_queries(query_set.read(0, len(query_set)).to(torch.float32))[qrows]
        raw_vectors = train.read(0, len(train))[rows]
        # batch by batch: each captured batch keeps its own token layout (concatenating batches of other widths
        # misplaces the tokens of a layer used twice per forward, e.g. a tied embedding)
        shares = _token_shares(train, [train.ids[r] for r in rows], q, "training examples")  # [n, T, Q]
        raw = raw_vectors @ q.t()
        scaled = self.method.prepare_train(raw_vectors) @ q.t()
        factor = torch.where(raw.abs() > 0, scaled / raw.where(raw.abs() > 0, torch.ones_like(raw)),
                             torch.zeros_like(raw))
        shares = shares * factor.unsqueeze(1)
        qids = [query_set.ids[i] for i in qrows]
        return {(qid, tid): shares[i, :, j].clone() for i, tid in enumerate(train_ids) for j, qid in enumerate(qids)}

    def module_scores(self, queries: Any, scores: Scores, k: int | None = None) -> list[dict[str, Any]]:
        """Split the score of the top and bottom ``k`` pairs of every query (default: as many as ``scores`` kept)
        by parameter block, and record them in ``scores.meta["modules"]`` (read back with
        :meth:`Scores.modules`). ``queries`` are the query gradients ``scores`` came from. Each pair's blocks sum
        to its score up to float32 round-off; influence methods split the preconditioned query. See
        :func:`gradtrace.score.pairs.module_attributions`."""
        from .pairs import module_attributions

        records = module_attributions(self, queries, scores, k)
        scores.meta["modules"] = records
        return records

    def token_attributions(self, queries: Any, scores: Scores, *, train_tokens: Any = None, query_side: bool = True,
                           tokens: Any = None, k: int | None = None) -> list[dict[str, Any]]:
        """Per-token attribution of the top and bottom ``k`` pairs of every query (default: as many as ``scores``
        kept), recorded in ``scores.meta["tokens"]`` (read back with :meth:`Scores.tokens`).

        ``queries`` are the query gradients ``scores`` came from, collected with ``keep_tokens=True`` for the
        query side; ``train_tokens`` the pairs' training examples re-collected with ``keep_tokens=True`` for the
        training side (None: none); ``tokens`` maps example ids to their tokens as strings (each side is cut
        to them; None: positions). Each side sums to the pair's score. See
        :func:`gradtrace.score.pairs.token_attributions`."""
        from .pairs import token_attributions, token_records

        shares = token_attributions(self, queries, scores, query_side=query_side, train_tokens=train_tokens, k=k)
        records = token_records(shares, tokens)
        scores.meta["tokens"] = records
        return records

    def self_scores(self, normalize: str = "none") -> Tensor:
        """``[N]`` score of every training example against itself (e.g. ``|g|^2`` for grad_dot, ``g^T H^-1 g`` for
        influence functions): high self-influence flags mislabeled or outlying examples.

        ``normalize="length"`` scores the gradient of each example's *mean* loss per target token instead of its
        summed loss (the captured convention): that gradient is ``g / n`` for ``n`` target tokens, so the
        example's row is divided by ``n`` before the method's transforms. For methods quadratic in the gradient
        (grad_dot, TracIn, every influence function) the self-influence is then divided by ``n^2`` -- not ``n``:
        ``(g/n)^T H^-1 (g/n)``; scale-free ones (grad_cos) are unchanged. Long examples no longer rank high for
        their length alone. Needs the per-row ``num_targets`` that collect records (stores written before it
        recorded them are refused); an example with no target token has a zero gradient and scores 0 either way.
        """
        if normalize not in ("none", "length"):
            raise ValueError(f"self_scores(normalize=...) must be 'none' or 'length', got {normalize!r}")
        weights = self.ready()
        scale = _inverse_lengths(self.train[0]) if normalize == "length" else None
        out = torch.zeros(len(self.train[0]))
        for offset in range(0, len(out), self.block_rows):
            stop = min(len(out), offset + self.block_rows)
            for c, source in enumerate(self.train):
                rows = source.read(offset, stop, self.device).to(torch.float32)
                if scale is not None:
                    rows = rows * scale[offset:stop, None].to(rows.device)
                left = self.method.prepare_queries(rows, c)
                right = self.method.prepare_train(rows, c)
                out[offset:stop] += weights[c] * (left * right).sum(1).cpu()
        return out


def _inverse_lengths(source: Any) -> Tensor:
    """``[N]`` float32 ``1 / num_targets`` of every row of ``source`` (its recorded per-row field; 1 for a row
    without target tokens, whose gradient is zero); a ValueError when the rows do not record it."""
    counts = source.field("num_targets")
    missing = sum(n is None for n in counts)
    if missing:
        where = getattr(source, "root", "these training gradients")
        raise ValueError(f"normalize='length' needs each example's target-token count, and {missing:,} of the "
                         f"{len(counts):,} rows of {where} do not record num_targets (stores collected before "
                         "gradtrace recorded it, or by a custom loss_fn); collect them again, or use normalize='none'")
    return 1.0 / torch.tensor(counts, dtype=torch.float32).clamp(min=1)


# rows decoded per product step when streaming a store on the CPU with one intra-op thread: ~8 MiB of float32, so
# that a sub-block is still in the last-level cache when the product reads it (a whole 8,192 x 4,096 block, 128 MiB,
# is written to memory by the decode and read back by the product: 30% more CPU time, measured). With several
# threads every sub-block adds two fork-joins (decode, product), which on a loaded machine cost more than the cache
# saves (measured on 2 shared cores: 1.5x the CPU time at 16 MiB sub-blocks): a block is then decoded whole.
SUB_BLOCK_BYTES = 8 * 2**20


def _block_buffer(sources: Sequence[Any], block_rows: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The float32 CPU buffers that gradient stores decode each streamed block into: rows ``[sub, D]`` (``sub``
    rows of at most :data:`SUB_BLOCK_BYTES` on the CPU with one thread, else a whole block) and per-row scales
    ``[block_rows]``; None when no source is a store (a fresh 128 MiB tensor per block costs as much as the
    decoding)."""
    from ..store import GradientStore

    stores = [s for s in sources if isinstance(s, GradientStore)]
    if not stores:
        return None
    rows = min(block_rows, max(len(s) for s in stores))
    sub = rows
    if device.type == "cpu" and torch.get_num_threads() == 1:
        sub = max(1, min(rows, SUB_BLOCK_BYTES // (4 * max(1, stores[0].dim))))
    return torch.empty(sub, stores[0].dim, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)


def folds_row_scales(method: Method) -> bool:
    """Whether ``method`` scores raw training rows (its ``prepare_train`` is the identity), so that a row's int8
    scale can multiply its scores instead of its values: ``q . (s * raw) = s * (q . raw)``, exact up to float32
    rounding (``grad_dot`` and the influence methods, which precondition the query side only)."""
    return type(method).prepare_train is Method.prepare_train


def _is_store(source: Any) -> bool:
    from ..store import GradientStore

    return isinstance(source, GradientStore)


def _prefetcher(attributor: Attributor, blocks: range, num_train: int) -> Any:
    """A :class:`~gradtrace.store.prefetch.BlockPrefetcher` of the store blocks of a scan, decoded as
    :func:`rows_product` reads them (int8 rows unscaled where the method folds their scales), or None."""
    from ..store.prefetch import prefetcher

    return prefetcher(attributor.prefetch, [s if _is_store(s) else None for s in attributor.train], blocks, num_train,
                      attributor.block_rows, folds_row_scales(attributor.method), attributor.device)


def _block_product(query: Tensor, source: Any, start: int, stop: int, method: Method, checkpoint: int,
                   buffer: tuple[Tensor, Tensor] | None, block: Any = None) -> Tensor:
    """``[Q, n]`` products ``query @ prepare_train(rows start:stop)^T`` of one streamed block at one checkpoint
    (a gradient store through :func:`rows_product`; ``block``: its rows read ahead, a
    :class:`~gradtrace.store.prefetch.Block`)."""
    if block is not None:  # the same products over the same sub-blocks as a read in place: bit-identical
        assert buffer is not None
        return rows_product(query, source, stop - start, lambda lo, hi, out, scales: block.take(lo, hi, scales),
                            method, checkpoint, buffer)
    if buffer is None or not _is_store(source):
        rows = source.read(start, stop, query.device).to(torch.float32)
        return query @ method.prepare_train(rows, checkpoint).t().to(query.dtype)
    return rows_product(query, source, stop - start, lambda lo, hi, out, scales: source.read(
        start + lo, start + hi, out=out, scales=scales), method, checkpoint, buffer)


def rows_product(query: Tensor, store: Any, count: int, read: Callable[[int, int, Tensor, Tensor | None], Tensor],
                 method: Method, checkpoint: int, buffer: tuple[Tensor, Tensor]) -> Tensor:
    """``[Q, count]`` products ``query @ prepare_train(rows)^T`` of ``count`` rows of a gradient store.

    ``read(lo, hi, out, scales)`` decodes rows ``lo:hi`` of the ``count`` into ``out`` (as
    :meth:`GradientStore.read` with ``scales``). The rows are decoded sub-block by sub-block into ``buffer``
    (:func:`_block_buffer`) and each sub-block's product written into its columns, so the decoded rows are read
    back from cache. For methods that score raw rows (:func:`folds_row_scales`) int8 rows are decoded unscaled
    and the columns of the product are scaled instead.
    """
    rows_buffer, scale_buffer = buffer
    fold = store.spec.dtype == "int8" and folds_row_scales(method)
    scales = (scale_buffer[:count] if count <= len(scale_buffer) else torch.empty(count)) if fold else None
    out = torch.empty(len(query), count, dtype=query.dtype, device=query.device)
    for lo in range(0, count, len(rows_buffer)):
        hi = min(count, lo + len(rows_buffer))
        rows = read(lo, hi, rows_buffer[:hi - lo], None if scales is None else scales[lo:hi])
        torch.mm(query, method.prepare_train(rows.to(query.device), checkpoint).t().to(query.dtype), out=out[:, lo:hi])
    return out if scales is None else out.mul_(scales.to(query.device))


def _positive_int(value: Any, name: str, minimum: int) -> int:
    """``value`` if it is an integer ``>= minimum``, else a ValueError naming the argument
    (:func:`gradtrace.common.checks.count`)."""
    return checked_count(value, name, minimum)


def _names(ids: Sequence[str], rows: Tensor, limit: int = 5) -> str:
    """The ids of the first ``limit`` of ``rows`` (a bool mask), for error messages."""
    index = rows.nonzero().flatten()
    names = [str(ids[i]) for i in index[:limit].tolist()]
    return f"{names}{' and ' + str(len(index) - limit) + ' more' if len(index) > limit else ''}"


def _check_prepared(prepared: Tensor, query_ids: Sequence[str], method: str, checkpoint: int) -> None:
    """Refuse preconditioned queries with NaN/inf (a NaN query gradient, or a curvature that breaks it)."""
    bad = ~torch.isfinite(prepared).all(dim=1)
    if bool(bad.any()):
        names = _names(query_ids, bad.cpu())
        raise ScoringError(f"{method}: the prepared (preconditioned) gradients of queries {names} hold NaN/inf at "
                           f"checkpoint {checkpoint}; check those queries' gradients and the method's curvature")


def _check_block(scores: Tensor, query_ids: Sequence[str], train_ids: Sequence[str], offset: int,
                 method: str) -> None:
    """Refuse a ``[Q, n]`` block of scores holding NaN/inf, naming the queries and training rows involved."""
    low, high = torch.aminmax(scores)  # one pass, no [Q, n] mask; NaN propagates to both
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return
    finite = torch.isfinite(scores)
    finite = finite.cpu()
    bad_queries, bad_rows = ~finite.all(dim=1), ~finite.all(dim=0)
    rows = bad_rows.nonzero().flatten()
    raise ScoringError(f"{method}: NaN/inf scores for queries {_names(query_ids, bad_queries)} against training rows "
                       f"{offset + int(rows[0])}..{offset + int(rows[-1])} (ids "
                       f"{_names(train_ids[offset:offset + scores.shape[1]], bad_rows)}) of the block starting at "
                       f"row {offset}; those training gradients hold NaN/inf or the scores overflow float32")


def _bar(blocks: Sequence[int], enabled: bool, rows: int, block_rows: int) -> Any:
    """A tqdm bar over the ``rows`` training rows, advanced block by block (its postfix: ``block i/K``), or None.

    It counts rows because a store smaller than ``block_rows`` is one block: a block count then sits at ``0/1``
    for the whole stream and shows no rate."""
    if not enabled:
        return None
    from ..common.progress import progress_bar

    bar = progress_bar(total=rows, desc="score", unit="row")  # tqdm on a terminal, plain lines in a log
    bar.set_postfix_str(f"block 0/{math.ceil(rows / block_rows)}")
    return bar


def _advance(bar: Any, rows: int, block: int, blocks: int) -> None:
    """Count one scored block of ``rows`` rows on the bar (no bar: nothing)."""
    if bar is not None:
        bar.set_postfix_str(f"block {block}/{blocks}", refresh=False)
        bar.update(rows)


def _close(bar: Any, ahead: Any = None) -> None:
    if bar is not None:
        bar.close()
    if ahead is not None:
        ahead.close()


def _recorded_coverage(source: Any) -> dict[str, Any] | None:
    """The coverage a training store's manifest records (``config["gradtrace"]["coverage"]``), None otherwise."""
    from ..capture.coverage import recorded_coverage

    manifest = getattr(source, "manifest", None)
    coverage = recorded_coverage(manifest) if isinstance(manifest, dict) else None
    return coverage.to_dict() if coverage is not None else None
