"""What the report shows, computed from ``Scores`` and texts: plain dataclasses the templates only lay out.

Token- and module-level attributions are read from ``Scores.meta`` when present (see ``docs/report.md``)::

    meta["tokens"]  = [{"query_id": q, "train_id": t,
                        "query_tokens": [str, ...], "query_scores": [float, ...],    # optional pair of lists
                        "train_tokens": [str, ...], "train_scores": [float, ...],    # optional pair of lists
                        "query_in_loss": [bool, ...], "train_in_loss": [bool, ...]}, # optional: loss tokens
                       ...]   # each side's scores sum to the pair's score
    meta["modules"] = [{"query_id": q, "train_id": t, "modules": {block name: float, ...}}, ...]
                              # the blocks sum to the pair's score
    meta["answers"] = {query id: generated answer}

:func:`pair_attributions` is the one place they are read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from markupsafe import Markup
from torch import Tensor

from ..options.base import option_object
from ..options.report import ReportOptions
from .errors import ReportError
from .header import coverage_warning, header_rows, units_line
from .svg import histogram_counts, histogram_of, histogram_svg

__all__ = ["ExampleRow", "Heat", "ModuleBar", "QueryView", "Rank", "Report", "SelfInfluence", "TrainingEntry",
           "TrainingIndex", "build_report", "pair_attributions"]

HEAT_LEVELS = 5
MAX_MODULE_BARS = 12
FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
RANK_TABLE_QUERIES = 24
"""Up to this many queries the training-example index is a table with every query's rank of each example (from
the full matrix when kept); with more, it lists only the queries whose kept top/bottom k hold the example, so the
file stays bounded by queries x k."""
PREVIEW_CHARS = 120  # characters of a training text in the training-example index (in full on the query pages)
CONSTANT_SPREAD = 1e-3
"""Self-influence values within this share of their magnitude are reported as all equal: float32 dot products
over tens of thousands of dimensions round grad_cos's exact 1 to 1 +- 1e-4 (measured on the demo's store)."""


@dataclass
class Heat:
    """Tokens with a signed heat level in ``-HEAT_LEVELS..HEAT_LEVELS`` (share of the largest |score|), score, and
    whether the token is in the loss (None: the attribution records no loss mask)."""

    tokens: list[tuple[str, int, float, bool | None]]
    cut: int = 0  # tokens left out (text too long)

    @property
    def marked(self) -> bool:
        """True when the loss tokens are known (``*_in_loss`` recorded)."""
        return bool(self.tokens) and self.tokens[0][3] is not None


@dataclass
class ModuleBar:
    name: str
    value: float
    width: float  # percent of the largest |value|


@dataclass
class ExampleRow:
    """One training example in a ranked list."""

    rank: int
    train_id: str
    score: float
    width: float  # bar length, percent of the largest |score| shown for the query
    text: str
    cut: int  # characters left out
    anchor: str = ""  # the example's entry in the training-example index
    train_heat: Heat | None = None
    query_heat: Heat | None = None
    modules: list[ModuleBar] | None = None
    modules_more: tuple[int, float] | None = None  # (blocks not drawn, their sum)


@dataclass
class QueryView:
    index: int
    query_id: str
    anchor: str
    text: str
    cut: int
    answer: str | None
    helpful: list[ExampleRow]
    harmful: list[ExampleRow]
    histogram: Markup | None
    page: int
    rank_note: str = ""


@dataclass
class Rank:
    """Where one training example ranks for one query: 1 = the most helpful of all training examples."""

    query: int  # position of the query
    rank: int | None  # None: not known (only the top/bottom k were kept and it is in neither)
    score: float | None
    side: str  # "pos": in the query's shown most helpful, "neg": in its shown most harmful, "": neither


@dataclass
class TrainingEntry:
    """One training example shown in the report, with its rank for the queries."""

    row: int  # position in the training set
    anchor: str
    train_id: str
    preview: str
    cut: int
    ranks: list[Rank]  # table: one per query, in query order; list: only the queries whose shown lists hold it


@dataclass
class TrainingIndex:
    """Every training example the report shows (in a query's lists or the self-influence list), in training order."""

    entries: list[TrainingEntry]
    table: bool  # one rank per query (at most RANK_TABLE_QUERIES queries), else only the shown ones
    complete: bool  # every query's rank is known (the full matrix was kept and the table is drawn)
    table_queries: int = RANK_TABLE_QUERIES


@dataclass
class SelfInfluence:
    method: str
    rows: list[ExampleRow]
    histogram: Markup
    constant: bool
    count: int
    train_rows: list[int] = field(default_factory=list)  # the listed examples' positions in the training set


@dataclass
class Report:
    title: str
    header: list[tuple[str, str]]
    sign: str
    units: str
    num_queries: int
    num_train: int
    k: int
    kept_note: str
    queries: list[QueryView]
    pages: int
    self_influence: SelfInfluence | None
    version: str
    notes: list[str] = field(default_factory=list)
    harmful_kept: bool = True  # False: the scores kept the top-k only (an index search with bottom=False)
    training: TrainingIndex | None = None
    diagnostics: list[str] = field(default_factory=list)  # what gradtrace score measured (meta["diagnostics"])
    warnings: list[str] = field(default_factory=list)  # and the warnings it raised, naming the fix

    @property
    def has_answers(self) -> bool:
        return any(q.answer is not None for q in self.queries)

    @property
    def loss_marked(self) -> bool:
        """Some token heat marks its loss tokens."""
        return any(heat.marked for q in self.queries for row in q.helpful + q.harmful
                   for heat in (row.train_heat, row.query_heat) if heat is not None)


# -- validation ----------------------------------------------------------------------------------------------
def check_finite(values: Tensor, what: str, row_ids: Sequence[str] | None, col_ids: Sequence[str],
                 columns: Tensor | None = None) -> None:
    """Refuse NaN/inf in ``values`` (``[Q, N]`` or ``[N]``), naming the first offending ids; ``columns`` (same
    shape as ``values``) maps kept top-k positions to training rows."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    where = bad.nonzero()[0].tolist()
    count = int(bad.sum())
    column = int(columns[tuple(where)]) if columns is not None else where[-1]
    if values.dim() == 2:
        place = f"query {row_ids[where[0]]!r}, training example {col_ids[column]!r}"  # type: ignore[index]
    else:
        place = f"training example {col_ids[column]!r}"
    raise ReportError(f"{what} holds {count} non-finite value{'s' if count > 1 else ''} (first: "
                      f"{float(values[tuple(where)])} at {place}); rescore, or drop the examples whose gradients "
                      "are NaN/inf")


def check_ids(wanted: Sequence[str], texts: Mapping[str, str], what: str, source: str) -> None:
    """Every id in ``wanted`` has a text in ``texts``, else one error naming the first missing id."""
    missing = [i for i in dict.fromkeys(wanted) if i not in texts]
    if missing:
        more = f" ({len(missing) - 1} more are missing too)" if len(missing) > 1 else ""
        raise ReportError(f"{what} id {missing[0]!r} is not in {source}{more}; pass the {what} data the scores "
                          "were computed from")


# -- token and module attributions ---------------------------------------------------------------------------
def _float_list(values: Any, where: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, (int, float)) for v in values):
        raise ReportError(f"{where}: expected a list of numbers")
    if not all(math.isfinite(v) for v in values):
        raise ReportError(f"{where} holds non-finite values")
    return [float(v) for v in values]


def _check_sum(parts: list[float], total: float, where: str, allowed: Any = None) -> None:
    """Parts of an exact decomposition sum to the pair's score up to float32 summation error, or up to the
    round-off bound ``allowed`` that the code which computed them recorded (``*_tolerance``: the parts and the
    score came from different float32 computations)."""
    magnitude = sum(abs(p) for p in parts) + abs(total)
    bound = 4 * FLOAT32_EPS * max(len(parts), 1) * magnitude + 1e-30
    if allowed is not None:
        if not isinstance(allowed, (int, float)) or not math.isfinite(allowed) or allowed < 0:
            raise ReportError(f"{where}: the recorded tolerance {allowed!r} is not a non-negative number")
        bound = max(bound, float(allowed))
    if abs(sum(parts) - total) > bound:
        raise ReportError(f"{where} sum to {sum(parts):.6g}, not the pair's score {total:.6g}; the attribution "
                          "belongs to other scores")


def pair_attributions(meta: Mapping[str, Any]) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], dict]]:
    """``(tokens, modules)`` keyed by ``(query id, train id)``, as stored in ``meta["tokens"]``/``meta["modules"]``
    (empty when the scores carry none)."""
    out: list[dict[tuple[str, str], dict]] = []
    for key in ("tokens", "modules"):
        entries = meta.get(key) or []
        if not isinstance(entries, list):
            raise ReportError(f"scores meta[{key!r}] must be a list of per-pair records (see docs/report.md)")
        by_pair = {}
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict) or "query_id" not in entry or "train_id" not in entry:
                raise ReportError(f"scores meta[{key!r}][{n}] needs 'query_id' and 'train_id' (see docs/report.md)")
            by_pair[(str(entry["query_id"]), str(entry["train_id"]))] = entry
        out.append(by_pair)
    return out[0], out[1]


def _loss_mask(in_loss: Any, count: int, where: str) -> list[bool | None]:
    """``*_in_loss``: one bool (or 0/1) per token, True for the tokens the loss is taken on; None: not recorded."""
    if in_loss is None:
        return [None] * count
    if not isinstance(in_loss, (list, tuple)) or not all(isinstance(v, (bool, int)) and v in (0, 1)
                                                          for v in in_loss):
        raise ReportError(f"{where} in_loss: expected one true/false (or 1/0) per token")
    if len(in_loss) != count:
        raise ReportError(f"{where}: {count} tokens but {len(in_loss)} in_loss flags")
    return [bool(v) for v in in_loss]


def _heat(tokens: Any, scores: Any, total: float, where: str, max_tokens: int, allowed: Any = None,
          in_loss: Any = None) -> Heat:
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ReportError(f"{where}: tokens must be a list of strings")
    values = _float_list(scores, f"{where} scores")
    if len(values) != len(tokens):
        raise ReportError(f"{where}: {len(tokens)} tokens but {len(values)} scores")
    _check_sum(values, total, f"{where} scores", allowed)
    mask = _loss_mask(in_loss, len(tokens), where)
    scale = max((abs(v) for v in values), default=0.0) or 1.0
    levels = [max(-HEAT_LEVELS, min(HEAT_LEVELS, round(v / scale * HEAT_LEVELS))) for v in values]
    return Heat(list(zip(tokens[:max_tokens], levels[:max_tokens], values[:max_tokens], mask[:max_tokens])),
                max(0, len(tokens) - max_tokens))


def _modules(entry: dict, total: float, where: str) -> tuple[list[ModuleBar], tuple[int, float] | None]:
    blocks = entry.get("modules")
    if not isinstance(blocks, dict) or not blocks:
        raise ReportError(f"{where}: 'modules' must map block names to numbers")
    values = _float_list(list(blocks.values()), f"{where} modules")
    _check_sum(values, total, f"{where} modules")
    ranked = sorted(zip(map(str, blocks), values), key=lambda nv: -abs(nv[1]))
    scale = max(abs(v) for _, v in ranked) or 1.0
    bars = [ModuleBar(name, value, 100 * abs(value) / scale) for name, value in ranked[:MAX_MODULE_BARS]]
    rest = ranked[MAX_MODULE_BARS:]
    return bars, ((len(rest), sum(v for _, v in rest)) if rest else None)


# -- building ------------------------------------------------------------------------------------------------
def _clip(text: str, max_chars: int) -> tuple[str, int]:
    return (text, 0) if len(text) <= max_chars else (text[:max_chars], len(text) - max_chars)


def _rows(query_id: str, ids: list[str], columns: list[int], values: list[float], scale: float,
          texts: Mapping[str, str], max_chars: int, tokens: dict, modules: dict) -> list[ExampleRow]:
    """Ranked rows of the training examples ``ids`` (at training positions ``columns``) with scores ``values``."""
    rows = []
    for rank, (tid, column, value) in enumerate(zip(ids, columns, values), start=1):
        text, cut = _clip(texts[tid], max_chars)
        row = ExampleRow(rank, tid, value, 100 * abs(value) / scale if scale else 0.0, text, cut, f"x{column}")
        where = f"token attribution of query {query_id!r} x training example {tid!r}"
        entry = tokens.get((query_id, tid))
        if entry is not None:
            if entry.get("train_tokens") is not None:
                row.train_heat = _heat(entry["train_tokens"], entry.get("train_scores"), value,
                                       f"{where} (training side)", max_chars, entry.get("train_tolerance"),
                                       entry.get("train_in_loss"))
            if entry.get("query_tokens") is not None:
                row.query_heat = _heat(entry["query_tokens"], entry.get("query_scores"), value,
                                       f"{where} (query side)", max_chars, entry.get("query_tolerance"),
                                       entry.get("query_in_loss"))
        entry = modules.get((query_id, tid))
        if entry is not None:
            row.modules, row.modules_more = _modules(entry, value,
                                                     f"module attribution of query {query_id!r} x {tid!r}")
        rows.append(row)
    return rows


def build_report(scores: Any, texts: Mapping[str, str], queries: Mapping[str, str],
                 options: ReportOptions | None = None, *, self_scores: Tensor | Mapping[str, float] | None = None,
                 self_method: str | None = None, text_source: str = "texts", query_source: str = "queries") -> Report:
    """The :class:`Report` of ``scores`` (arguments and errors as for :func:`gradtrace.report.render_report`, the
    texts as ``{id: text}``; ``text_source`` / ``query_source``: where they came from, as errors name them)."""
    from ..fit.methods.base import SIGN_CONVENTION
    from ..version import __version__

    options = option_object(options, ReportOptions, "options")
    num_train = len(scores.train_ids)
    k = min(options.k, num_train)
    if scores.matrix is not None:
        check_finite(scores.matrix, "the score matrix", scores.query_ids, scores.train_ids)
    for name in ("top", "bottom"):
        kept = getattr(scores, name)
        if kept is not None:
            check_finite(kept[0], f"the kept {name}-k scores", scores.query_ids, scores.train_ids, kept[1])
    try:
        helpful = scores.topk(k, largest=True)
        harmful = scores.topk(k, largest=False) if scores.has_bottom else None  # None: an index's top-k only
    except ValueError as err:
        raise ReportError(f"{err} (or report fewer with ReportOptions(k=) / --k)") from None
    check_ids(scores.query_ids, queries, "query", query_source)
    shown = [t for row in helpful.ids + (harmful.ids if harmful is not None else []) for t in row]
    self_view = None
    if self_scores is not None:
        self_view = _self_influence(scores, self_scores, self_method or scores.method, texts, options.self_k,
                                    options.max_chars, text_source)
    check_ids(shown, texts, "training", text_source)
    views = _query_views(scores, helpful, harmful, texts, queries, options.max_chars, options.per_page)
    training = _training_index(scores, helpful, harmful, self_view, texts)
    sides = "top/bottom" if harmful is not None else "top"
    kept = ("full score matrix" if scores.matrix is not None else
            f"{sides} {scores.top[0].shape[1] if scores.top is not None else 0} per query only (no matrix): "
            "score distributions are not shown; score with the full matrix (gradtrace score --matrix yes) to see "
            "them")
    if harmful is None:
        kept += ("; the most harmful examples were not kept (scored through an index with --no-bottom / "
                 "bottom=False)")
    return Report(title=options.title or f"GradTrace report: {scores.method}", header=header_rows(scores),
                  sign=SIGN_CONVENTION + "; negative = it hurts the query (a step on it raises the query's loss)",
                  units=units_line(scores), num_queries=len(scores.query_ids), num_train=num_train, k=k,
                  kept_note=kept, queries=views, harmful_kept=harmful is not None,
                  pages=max(1, math.ceil(len(views) / options.per_page)), self_influence=self_view, version=__version__,
                  training=training, diagnostics=list((scores.meta.get("diagnostics") or {}).get("lines", [])),
                  warnings=list((scores.meta.get("diagnostics") or {}).get("warnings", [])) + coverage_warning(scores))


def _query_views(scores: Any, helpful: Any, harmful: Any | None, texts: Mapping[str, str], queries: Mapping[str, str],
                 max_chars: int, per_page: int) -> list[QueryView]:
    """One :class:`QueryView` per query: its text, ranked rows, and (with the full matrix) its distribution."""
    tokens, modules = pair_attributions(scores.meta)
    answers = scores.meta.get("answers") or {}
    matrix = scores.matrix
    if matrix is not None:  # every query's distribution at once
        counts, lows, highs = histogram_counts(matrix)
        medians, means, stds = matrix.median(dim=1).values.tolist(), matrix.mean(dim=1).tolist(), \
            matrix.std(dim=1).tolist()
    views = []
    for q, qid in enumerate(scores.query_ids):
        top_values = helpful.values[q].tolist()
        low_values = harmful.values[q].tolist() if harmful is not None else []
        scale = max(abs(v) for v in top_values + low_values)
        text, cut = _clip(queries[qid], max_chars)
        view = QueryView(q, qid, f"q{q}", text, cut, answers.get(qid), [], [], None, q // per_page + 1)
        view.helpful = _rows(qid, helpful.ids[q], helpful.indices[q].tolist(), top_values, scale, texts, max_chars,
                             tokens, modules)
        if harmful is not None:
            view.harmful = _rows(qid, harmful.ids[q], harmful.indices[q].tolist(), low_values, scale, texts,
                                 max_chars, tokens, modules)
        if matrix is not None:
            view.histogram = histogram_svg(counts[q], float(lows[q]), float(highs[q]), top_values, low_values)
            if len(scores.train_ids) > 1:  # how far the top example stands out
                spread = (top_values[0] - means[q]) / max(stds[q], 1e-30)
                view.rank_note = (f"Median {medians[q]:.4g}; the top example is {spread:.1f} standard deviations "
                                  "above the mean.")
        views.append(view)
    return views


def _training_index(scores: Any, helpful: Any, harmful: Any | None, self_view: SelfInfluence | None,
                    texts: Mapping[str, str]) -> TrainingIndex:
    """Every training example the report shows, with where it ranks for each query: its place in the query's kept
    lists (Scores' own order; the r-th most harmful ranks N - r + 1), and, in the table with the full matrix, for
    the other queries ``1 + #(scores above it)``."""
    num_queries, num_train = len(scores.query_ids), len(scores.train_ids)
    shown: list[dict[int, Rank]] = [{} for _ in range(num_queries)]  # per query: training row -> its place
    for q in range(num_queries):
        if harmful is not None:  # helpful below overrides, when N < 2k puts an example in both lists
            for r, (j, value) in enumerate(zip(harmful.indices[q].tolist(), harmful.values[q].tolist())):
                shown[q][j] = Rank(q, num_train - r, value, "neg")
        for r, (j, value) in enumerate(zip(helpful.indices[q].tolist(), helpful.values[q].tolist()), start=1):
            shown[q][j] = Rank(q, r, value, "pos")
    listed = [j for places in shown for j in places] + (self_view.train_rows if self_view is not None else [])
    rows = sorted(set(listed))
    table = num_queries <= RANK_TABLE_QUERIES
    complete = table and scores.matrix is not None
    if complete:  # 1 + how many training examples score above it, for every (query, listed example)
        matrix = scores.matrix  # [Q, N]
        listed_scores = matrix[:, torch.tensor(rows, dtype=torch.long)].contiguous()  # [Q, U]
        above = num_train - torch.searchsorted(matrix.sort(dim=1).values, listed_scores, right=True)  # [Q, U]
        ranks_of, scores_of = (above + 1).T.tolist(), listed_scores.T.tolist()  # [U][Q]
    if not table:  # the shown places only, in query order
        places_of: dict[int, list[Rank]] = {j: [] for j in rows}
        for places in shown:
            for j, place in places.items():
                places_of[j].append(place)
    entries = []
    for u, j in enumerate(rows):
        tid = scores.train_ids[j]
        if table:
            ranks = [shown[q].get(j) or (Rank(q, ranks_of[u][q], scores_of[u][q], "") if complete else
                                         Rank(q, None, None, "")) for q in range(num_queries)]
        else:
            ranks = places_of[j]
        preview, cut = _clip(texts[tid], PREVIEW_CHARS)
        entries.append(TrainingEntry(j, f"x{j}", tid, preview, cut, ranks))
    return TrainingIndex(entries, table, complete)


def _self_influence(scores: Any, self_scores: Tensor | Mapping[str, float], method: str, texts: Mapping[str, str],
                    self_k: int, max_chars: int, text_source: str) -> SelfInfluence:
    if isinstance(self_scores, Mapping):
        missing = [t for t in scores.train_ids if t not in self_scores]
        if missing:
            raise ReportError(f"self_scores has no value for training example {missing[0]!r} ({len(missing)} "
                              "missing); give one per training example")
        values = torch.tensor([float(self_scores[t]) for t in scores.train_ids], dtype=torch.float32)
    else:
        values = torch.as_tensor(self_scores, dtype=torch.float32).flatten()
        if values.numel() != len(scores.train_ids):
            raise ReportError(f"self_scores has {values.numel()} values for {len(scores.train_ids)} training "
                              "examples; give one per training example, in the scores' order")
    check_finite(values, "the self-influence scores", None, scores.train_ids)
    top_values, top_indices = torch.topk(values, min(self_k, values.numel()))
    ids = [scores.train_ids[j] for j in top_indices.tolist()]
    check_ids(ids, texts, "training", text_source)
    top = top_values.tolist()
    scale = max(abs(v) for v in top)
    rows = _rows("", ids, top_indices.tolist(), top, scale, texts, max_chars, {}, {})
    constant = bool((values.max() - values.min()) <= CONSTANT_SPREAD * values.abs().max().clamp_min(1e-30))
    return SelfInfluence(method, rows, histogram_of(values, top), constant, values.numel(), top_indices.tolist())
