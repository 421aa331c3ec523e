"""Scoring: the blocked, streaming engine, the ``Scores`` container, and index-shortlisted scoring."""

from .engine import Attributor, ScoringError
from .ensemble import Ensemble, EnsembleError
from .index import Index, IndexMismatch, build_index
from .scores import Scores, ScoresError, TopK
from .shortlist import score_with_index
from .unrolled import Unrolled

__all__ = ["Attributor", "Index", "IndexMismatch", "Scores", "ScoresError", "ScoringError", "TopK", "build_index",
           "score_with_index"]
__all__ += ["Ensemble", "EnsembleError", "Unrolled"]
