"""Scoring: the blocked, streaming engine and the ``Scores`` container."""

from .engine import Attributor
from .scores import Scores, TopK

__all__ = ["Attributor", "Scores", "TopK"]
