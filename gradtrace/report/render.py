"""Rendering a :class:`~gradtrace.report.content.Report` to one self-contained HTML file with jinja2.

Templates ship as package data (``gradtrace/report/templates``); the environment autoescapes everything, so
training texts, ids and tokens (``<script>`` included) are shown as text, never run. The page has no external
resource: paging is CSS (``:target``), plots are inline SVG. Its one script (``report.js``, the search box of the
training-example index) only enhances it: the page is complete without it, and its Content-Security-Policy runs
that script alone (by its hash), so no script can come from a text.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import Tensor

from ..options.report import ReportOptions
from ..store.atomic import atomic_output
from .content import Report, build_report
from .errors import ReportError
from .texts import DataSource, read_texts, recorded_sources, resolve_source

__all__ = ["render_html", "render_report", "write_atomic"]

TEMPLATE = "report.html.j2"
SCRIPT = "report.js"
FILE_MODE = 0o644


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("gradtrace.report", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["signed"] = lambda v: f"{v:+.4g}"
    return env


def _texts(given: Mapping[str, str] | str | Path | None, recorded: DataSource | None, what: str, option: str
           ) -> tuple[Mapping[str, str], str]:
    """Texts given as a mapping, a data file, or (None) the data recorded with the scores; and where they came
    from (for error messages)."""
    if isinstance(given, Mapping):
        return given, f"the given {option}"
    source = resolve_source(given, recorded, what=what, option=f"{option}= (a mapping {{id: text}} or a .jsonl/.txt "
                            "file)")
    return read_texts(source, what=what), f"{what} file {source.path}"


def render_report(scores: Any, texts: Mapping[str, str] | str | Path | None = None,
                  queries: Mapping[str, str] | str | Path | None = None, out: str | Path | None = None,
                  options: ReportOptions | None = None, *, self_scores: Tensor | Mapping[str, float] | None = None,
                  self_method: str | None = None) -> str:
    """Render ``scores`` as one self-contained HTML page; write it to ``out`` when given. Returns the HTML.

    Args:
        scores: a :class:`gradtrace.Scores`.
        texts: training texts: ``{train id: text}``, a .jsonl/.txt file, or None for the training data recorded
            by ``gradtrace collect``/``score``.
        queries: query texts, the same way.
        out: file to write (atomically: a failed render leaves an existing file as it was).
        options: what the page shows (:class:`gradtrace.options.report.ReportOptions`: ``k`` examples per query,
            ``per_page`` queries per page, ``max_chars`` of each text, ``self_k`` self-influence examples,
            ``title``; default ``ReportOptions()``).
        self_scores: ``[N]`` self-influence of every training example (``Attributor.self_scores()``), in the
            scores' training order, or ``{train id: value}``: adds a self-influence section.
        self_method: the method the self-influence was computed with (default: the scores' method).
    Raises:
        TypeError: ``options`` is not a ``ReportOptions``.
        ReportError: texts that cannot be read or lack a shown id; non-finite scores, fewer kept than ``k``, or
            attributions and self-influence that do not fit the scores; an ``out`` that is a directory.
    """
    train_source, query_source = recorded_sources(scores.meta)
    train_texts, train_from = _texts(texts, train_source, "training data", "texts")
    query_texts, query_from = _texts(queries, query_source, "queries", "queries")
    report = build_report(scores, train_texts, query_texts, options, self_scores=self_scores,
                          self_method=self_method, text_source=train_from, query_source=query_from)
    html = render_html(report)
    if out is not None:
        write_atomic(Path(out), html)
    return html


def render_html(report: Report) -> str:
    """The HTML page of a built :class:`Report`."""
    script = _source(SCRIPT)
    return _environment().get_template(TEMPLATE).render(report=report, css=_source("report.css"), script=script,
                                                        script_hash=script_hash(script))


@lru_cache(maxsize=4)
def _source(name: str) -> str:
    return _environment().loader.get_source(_environment(), name)[0]


def script_hash(script: str) -> str:
    """The Content-Security-Policy source that allows the inline ``script`` and nothing else: ``'sha256-...'``."""
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own, fsynced and renamed into place
    (:func:`gradtrace.store.atomic.atomic_output`): a failure -- a full disk -- leaves an existing file as it was."""
    if path.is_dir():
        raise ReportError(f"{path} is a directory; give the report's file name (e.g. {path / 'report.html'})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.chmod(tmp, FILE_MODE)  # an ordinary shareable file, whatever the umask
