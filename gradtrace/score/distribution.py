"""Each query's score distribution over all training rows, accumulated while the scores stream.

The engine keeps only a top-k for large stores, so how far the top stands out of the rest must be measured on the
way: per query, the number of rows, the mean and the standard deviation of its scores (float64 sums of each block,
kept on the scoring device: no host sync per block). Saved with the scores as ``meta["distribution"]``
(``{"rows": N, "mean": [Q], "std": [Q]}``) and read by :mod:`gradtrace.score.diagnostics`.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

__all__ = ["ScoreDistribution"]


class ScoreDistribution:
    """Running per-query ``sum`` and ``sum of squares`` of a stream of ``[Q, n]`` score blocks (float64)."""

    def __init__(self, num_queries: int, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(num_queries, dtype=torch.float64, device=device)
        self.squares = torch.zeros(num_queries, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, block: Tensor) -> None:
        """Add the ``[Q, n]`` scores of ``n`` more training rows."""
        self.sums += block.sum(dim=1, dtype=torch.float64)
        # squared in float64: a float32 square of a large grad_dot score (above ~1.8e19) would overflow to inf
        self.squares += torch.linalg.vector_norm(block, dim=1, dtype=torch.float64).square()
        self.rows += block.shape[1]

    def meta(self) -> dict[str, Any]:
        """``{"rows", "mean": [Q], "std": [Q]}`` (population standard deviation) as JSON-able lists."""
        if self.rows == 0:
            return {"rows": 0, "mean": [], "std": []}
        mean = self.sums / self.rows
        var = (self.squares / self.rows - mean.square()).clamp_min(0)
        return {"rows": self.rows, "mean": mean.cpu().tolist(), "std": var.sqrt().cpu().tolist()}

    @staticmethod
    def of_matrix(matrix: Tensor) -> dict[str, Any]:
        """The ``meta()`` of a whole ``[Q, N]`` score matrix (scores computed without the engine's stream)."""
        dist = ScoreDistribution(matrix.shape[0], matrix.device)
        dist.add(matrix)
        return dist.meta()


def expected_maximum(rows: int) -> float:
    """About how many standard deviations the largest of ``rows`` independent Gaussian scores lies above their
    mean: what a top-1 of pure noise reaches (Blom's approximation of the largest order statistic,
    ``Phi^-1((N - 0.375) / (N + 0.25))``, within 0.01 of the exact value from 10 rows up)."""
    if rows < 2:
        return 0.0
    return NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
