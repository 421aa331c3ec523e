"""Scoring: the blocked, streaming engine and the ``Scores`` container."""

from .engine import Attributor, ScoringError
from .scores import Scores, ScoresError, TopK

__all__ = ["Attributor", "Scores", "ScoresError", "ScoringError", "TopK"]
