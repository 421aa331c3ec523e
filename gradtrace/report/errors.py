"""The report's bad-input error."""

from __future__ import annotations

__all__ = ["ReportError"]


class ReportError(ValueError):
    """Scores or texts that cannot be reported (missing texts, unknown ids, non-finite scores, malformed
    token/module attributions); the message names the id or option and what to do."""
