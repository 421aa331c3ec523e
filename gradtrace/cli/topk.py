"""``gradtrace topk SCORES_DIR``: the most influential training examples of each query, readable."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

from ..common.paths import why_missing
from ..common.provenance import resolve_paths
from .commands import QUIET_PROGRESS, cli, progress_flag
from .config import read_resolved
from .console import console
from .errors import CliError
from .groups import TextOptions

__all__ = ["OPTIONS", "TopkCommand", "run"]


@dataclass(kw_only=True)
class TopkCommand:
    """Options of ``gradtrace topk``."""

    scores: Path = field(metadata=cli("Directory of saved scores (written by gradtrace score).", argument=True,
                                      metavar="SCORES_DIR"))
    k: int = field(default=10, metadata=cli("Training examples shown per query.", "--k", "-k", min=1))
    query: list[str] = field(default_factory=list, metadata=cli(
        "Show only this query id (repeat for several).", "--query", "-q"))
    bottom: bool = field(default=False, metadata=cli(
        "Show the lowest scores (the examples that hurt the query most) instead."))
    text_options: TextOptions
    format: Literal["table", "csv", "json"] = field(default="table", metadata=cli(
        "Output: a table, or CSV/JSON rows on stdout.", "--format", "-f"))
    width: int = field(default=60, metadata=cli("Characters of text shown per snippet in the table.", min=10))
    progress: bool = progress_flag(QUIET_PROGRESS)


OPTIONS = TopkCommand


def run(opts: TopkCommand) -> None:
    """Show the top-k training examples of each query, with their texts.

    The texts come from the training data the store was collected from and the query file gradtrace score read
    (when they still exist), or from --data and --queries.

    Positive score = the training example helps the query (lowers its loss); --bottom shows the most harmful.

    Example: gradtrace topk ./scores --k 5
    """
    from ..report.texts import recorded_sources
    from ..score import Scores

    if not opts.scores.exists():
        raise CliError(f"score directory {opts.scores} {why_missing(opts.scores)}")
    if not (opts.scores / "scores.json").exists():
        raise CliError(f"{opts.scores} holds no saved scores (no scores.json); write them with gradtrace score")
    scores = Scores.load(opts.scores)
    rows = _rows(scores, opts)
    for warning in (scores.meta.get("diagnostics") or {}).get("warnings", []):  # recorded by gradtrace score
        console(stderr=True).print(f"Warning: {warning}", style="yellow", markup=False, soft_wrap=True)
    texts = opts.text_options
    config = scores.meta.get("config") or resolve_paths(read_resolved(opts.scores, "score") or {}, opts.scores)
    train_source, query_source = recorded_sources({"config": config})
    train_texts = _side_texts(texts, "train", train_source)
    if train_texts is not None:
        for row in rows:
            row["train_text"] = train_texts.get(row["train_id"])
    answers = scores.meta.get("answers") or {}  # gradtrace score --generate: the model's answers
    if answers:
        for row in rows:
            row["answer"] = answers.get(row["query_id"])
    query_texts = _side_texts(texts, "query", query_source) or {}
    if query_texts:
        for row in rows:
            row["query_text"] = query_texts.get(row["query_id"])
    if opts.format == "json":
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    elif opts.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]) if rows else ["query_id", "rank", "train_id"],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        _print_tables(scores, rows, opts, query_texts, train_texts is not None)


def _side_texts(texts: TextOptions, side: Literal["train", "query"], recorded: Any) -> dict[str, str] | None:
    """``{id: text}`` of one side: from --data/--queries when given (an error if they cannot be read); else from the
    file the store/scores record, when it exists and reads (a data file changed since: a warning line on stderr;
    one that no longer reads: a warning line and no texts); None without either."""
    given = texts.data if side == "train" else texts.queries
    if given is None and (recorded is None or not recorded.path.exists()):
        return None
    try:
        return texts.texts(side, recorded)[0]
    except CliError as err:
        if given is not None:
            raise
        flag = "--data" if side == "train" else "--queries"
        console(stderr=True).print(f"Warning: texts not shown: {err}; pass {flag}", style="yellow", markup=False,
                                   soft_wrap=True)
        return None


def _rows(scores: Any, opts: TopkCommand) -> list[dict[str, Any]]:
    wanted = list(opts.query)
    unknown = [q for q in wanted if q not in set(scores.query_ids)]
    if unknown:
        sample = ", ".join(scores.query_ids[:5]) + (", ..." if len(scores.query_ids) > 5 else "")
        raise CliError(f"query id {unknown[0]!r} is not in {opts.scores} (its queries: {sample})")
    records = scores.to_records(opts.k, largest=not opts.bottom)
    return [r for r in records if not wanted or r["query_id"] in wanted]


def _snippet(text: str | None, width: int) -> str:
    if text is None:
        return "(not in the data)"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def _print_tables(scores: Any, rows: list[dict[str, Any]], opts: TopkCommand, query_texts: dict[str, str],
                  show_text: bool) -> None:
    out = console()
    which = "lowest (most harmful)" if opts.bottom else "highest (most helpful)"
    ensemble = bool((scores.meta or {}).get("ensemble"))
    out.print(f"{'Ensemble ' if ensemble else ''}[bold]{scores.method}[/bold] scores of {len(scores.query_ids):,} "
              f"queries against {len(scores.train_ids):,} training examples: top {opts.k} {which} per query.")
    if scores.combination:
        out.print(f"Combines: {scores.combination}.")
    if ensemble:  # not the method's values (a grad_cos ensemble's are not cosines)
        out.print(f"Scores: {scores.units}.")
    answered_by = ((scores.meta or {}).get("config") or {}).get("answer_model")
    if answered_by and any(row.get("answer") is not None for row in rows):
        out.print(f"Answers generated by {answered_by}.", markup=False, highlight=False)
    by_query: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_query.setdefault(row["query_id"], []).append(row)
    for query_id, query_rows in by_query.items():
        title = f"query {query_id}"
        if query_id in query_texts:
            title += f": {_snippet(query_texts[query_id], opts.width)}"
        if query_rows[0].get("answer") is not None:
            title += f"\n  model's answer: {_snippet(query_rows[0]['answer'], opts.width)}"
        table = Table(title=title, title_justify="left", show_edge=False)
        table.add_column("rank", justify="right")
        table.add_column("train id", overflow="fold")
        table.add_column("score", justify="right")
        if show_text:
            table.add_column("text", overflow="fold")
        for row in query_rows:
            cells = [str(row["rank"]), str(row["train_id"]), f"{row['score']:.4g}"]
            if show_text:
                cells.append(_snippet(row.get("train_text"), opts.width))
            table.add_row(*cells)
        out.print(table)
    out.print("Sign: positive score = the training example helps the query (a gradient step on it lowers the "
              "query's loss); negative = it hurts.")
