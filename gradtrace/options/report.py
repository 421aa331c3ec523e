"""What the HTML report of a set of scores shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import check_fields


@dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """What the HTML report shows (:func:`gradtrace.report.render_report`, :func:`gradtrace.report.build_report`,
    :meth:`gradtrace.Scores.to_html`).

    Attributes:
        k: helpful and harmful training examples shown per query (at most the training examples; >= 1).
        per_page: queries per page (pages are switched by links; the file holds them all; >= 1).
        max_chars: characters (and tokens) of a text shown; the rest is cut and counted (>= 1).
        self_k: training examples listed in the self-influence section (>= 1).
        title: the page's title (None: ``"GradTrace report: <method>"``).
    """

    k: int = field(default=5, metadata={"help": "Helpful and harmful training examples shown per query.", "min": 1})
    per_page: int = field(default=20, metadata={"help": "Queries per page of the report.", "min": 1})
    max_chars: int = field(default=600, metadata={"help": "Characters of each text shown (the rest is cut).",
                                                  "min": 1})
    self_k: int = field(default=20, metadata={"help": "Training examples listed by self-influence.", "min": 1})
    title: str | None = None

    def __post_init__(self) -> None:
        if self.title is not None and not isinstance(self.title, str):
            raise TypeError(f"title must be a string, got {type(self.title).__name__}")
        check_fields(self)
