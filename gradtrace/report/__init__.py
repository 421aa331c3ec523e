"""The HTML report of attribution scores: one self-contained, offline file per run.

``render_report(scores, texts=..., queries=..., out="report.html")`` or ``scores.to_html("report.html")``;
on the command line ``gradtrace report SCORES_DIR --out report.html``. See ``docs/report.md``.
"""

try:
    import jinja2  # noqa: F401  (markupsafe comes with it)
except ImportError:  # pragma: no cover - torch installs jinja2
    raise ImportError("the HTML report needs jinja2: pip install 'gradtrace[report]'") from None

from .content import Report, build_report, pair_attributions
from .errors import ReportError
from .render import render_html, render_report, write_atomic
from .texts import DataSource, read_texts, recorded_sources, resolve_source

__all__ = ["DataSource", "Report", "ReportError", "build_report", "pair_attributions", "read_texts",
           "recorded_sources", "render_html", "resolve_source", "render_report", "write_atomic"]
