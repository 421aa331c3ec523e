"""How an approximate index over a gradient store is built, and how scoring searches it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields
from .base import _choice

INDEX_KINDS = ("auto", "flat", "ivfpq")


@dataclass(frozen=True, kw_only=True)
class IndexOptions:
    """How an index is built (see :func:`gradtrace.score.build_index`).

    Attributes:
        kind: ``"flat"`` (exact inner product over float32 copies of all rows), ``"ivfpq"`` (an inverted file of
            k-means cells with product-quantized rows, trained on a sample) or ``"auto"`` (flat below 10,000 rows,
            ivfpq from there or when an ivfpq setting -- ``nlist``, ``m``, ``nbits``, ``fast_scan`` -- is given).
        normalize: index unit-norm rows: the index for ``grad_cos`` (and only for it).
        nlist: ivfpq cells (>= 1; default ``round(sqrt(rows))``, at most ``train_rows / 39``).
        m: ivfpq sub-quantizers, a divisor of the store's dimension (>= 1; default the largest divisor
            ``<= dim / 16``, or ``<= dim / 8`` with ``fast_scan``: one byte per 16 dims either way).
        nbits: bits per sub-quantizer code (1 to 16; default 8, and 4, the only width, with ``fast_scan``).
        train_rows: rows sampled uniformly (seeded) to train the quantizers (>= 1; at most the store's rows).
        seed: the training sample's seed (a 64-bit integer).
        fast_scan: ivfpq with 4-bit codes searched by FAISS's SIMD fast-scan kernels (``PQ{m}x4fs``).

    Raises:
        ValueError: a kind outside :data:`INDEX_KINDS`, ``fast_scan`` with ``kind="flat"`` or with ``nbits`` other
            than 4, or a number outside its range (naming the field).
    """

    kind: str = field(default="flat", metadata={"help": (
        "flat: exact inner product over float32 copies of all rows (rows x dim x 4 bytes in memory); ivfpq: "
        "inverted file of k-means cells with product-quantized rows (compact; trained on a sample); auto: flat "
        "below 10,000 rows (too few to train ivfpq's codebooks, whose index would be larger than the rows), else "
        "ivfpq, and ivfpq whenever an ivfpq option is given.")})
    normalize: bool = field(default=False, metadata={
        "help": "Index unit-norm rows: the index for --method grad_cos (and only for it)."})
    nlist: int | None = field(default=None, metadata={
        "help": "ivfpq: number of k-means cells (default: sqrt(rows), at most train-rows / 39).", "min": 1})
    m: int | None = field(default=None, metadata={"help": (
        "ivfpq: PQ sub-quantizers, a divisor of the store's dimension (default: the largest divisor <= dim/16, or "
        "<= dim/8 with --fast-scan: one byte per 16 dims either way)."), "min": 1})
    nbits: int | None = field(default=None, metadata={
        "help": "ivfpq: bits per sub-quantizer code (default 8; 4 with --fast-scan).", "min": 1, "max": 16})
    train_rows: int = field(default=65536, metadata={
        "help": "ivfpq: rows sampled uniformly from the store to train the quantizers.", "min": 1})
    seed: int = field(default=0, metadata={"help": "Seed of the training sample.", "valid": SEED})
    fast_scan: bool = field(default=False, metadata={"help": (
        "ivfpq: 4-bit codes searched with FAISS's SIMD fast-scan kernels (PQ<m>x4fs): several times faster to "
        "search and build than 8-bit codes of the same size, with coarser approximate scores (the shortlist is "
        "re-scored exactly either way).")})

    def __post_init__(self) -> None:
        _choice(self.kind, "kind", INDEX_KINDS)
        check_fields(self)
        if self.fast_scan and self.kind == "flat":
            raise ValueError("fast_scan applies to kind='ivfpq' (4-bit PQ codes); a flat index stores the rows "
                             "themselves")
        if self.fast_scan and self.nbits not in (None, 4):
            raise ValueError(f"fast-scan PQ codes are 4 bits wide; nbits={self.nbits} was given: leave nbits unset "
                             "(or 4) with fast_scan, or drop fast_scan for other widths")


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How scoring through an index searches it and re-scores the shortlist (see
    :func:`gradtrace.score.score_with_index`).

    Attributes:
        topk: rows kept per query, highest and (``bottom``) lowest (>= 1; at most the store's rows).
        rerank: shortlist size per query, re-scored exactly (>= 1; default ``10 * topk``; at most the store's rows,
            at least ``topk``).
        bottom: also search and re-score the bottom-k (with the negated query); False keeps the top-k only.
        nprobe: IVF cells visited per query (>= 1; default: the index's, ``min(nlist, 16)``); a query whose cells
            hold fewer than ``topk`` rows is searched again with twice the cells.
        bottom_nprobe: IVF cells visited for the bottom-k's search (>= 1; default ``nprobe``). A query's most
            negative rows lie thinly in many cells, so more cells raise the bottom's recall (see docs/index.md).
        norm_rows: the ``N`` rows of largest norm join every query's candidates, for the top and the bottom
            (>= 0; 0: none); scored exactly once against all queries. Needs an index that records row norms, of
            raw rows.
    """

    topk: int = field(default=100, metadata={"min": 1})
    rerank: int | None = field(default=None, metadata={
        "help": "With --index: rows shortlisted per query and re-scored exactly (default: 10 x --topk).", "min": 1})
    bottom: bool = field(default=True, metadata={"help": (
        "With --index: also search and re-score the bottom-k (most harmful); --no-bottom keeps the top-k only, "
        "about twice as fast (the exact pass keeps both at almost no cost, so it needs --index).")})
    nprobe: int | None = field(default=None, metadata={"help": (
        "With an ivfpq --index: IVF cells searched per query (default: the index's, min(nlist, 16)); a query whose "
        "cells hold fewer than --topk rows is searched again with more."), "min": 1})
    bottom_nprobe: int | None = field(default=None, metadata={"help": (
        "With an ivfpq --index: IVF cells searched for the bottom-k (default: --nprobe); its rows lie thinly in "
        "many cells, so more cells raise its recall."), "min": 1})
    norm_rows: int = field(default=0, metadata={"help": (
        "With --index: the N rows of largest norm join every query's shortlist, top and bottom (scored once for all "
        "queries; they hold much of the bottom-k). 0: none. Needs an index with row norms (--add-norms)."),
        "min": 0})

    def __post_init__(self) -> None:
        check_fields(self)
