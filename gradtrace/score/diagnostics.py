"""Is this ranking to be trusted? Diagnostics computed with every score, and the warnings they raise.

A converged fine-tune can make every single-model method rank the right training examples last with nothing to
show for it: the model has memorised its training set, so each training example's loss -- and with it its
gradient -- is close to zero, while the queries (paraphrases, new prompts) still have a loss to lower. Two signals,
both cheap:

* **gradient ratio**: the median norm of the training rows' gradients over the median norm of the queries'
  (the same projection on both sides, so the ratio is that of the raw gradients' norms up to the projection's
  distortion). Healthy runs sit near 1; a memorised training set makes it small. Below
  :data:`MEMORISED_BELOW` the warning names the fix: score the run's checkpoints (an ensemble, or an earlier one).
* **agreement** (several checkpoints or models): how much the members' own top-10 overlap, with each other and
  with the combined ranking (:mod:`gradtrace.score.agreement`); shown, not judged (no threshold measured yet).
* **standout**: per query, how many standard deviations its top score lies above the mean of its scores over all
  training rows, against what the top of that many rows of pure noise reaches (:func:`expected_maximum`). A
  query whose top-1 is no more than noise's (``standout - expected_maximum < STANDOUT_MARGIN``) has no training
  example that explains it better than chance.

The thresholds were fixed before ``bench/converged_sft.py`` first ran; its rates (every collapsed final model warned,
no healthy checkpoint warned, partly collapsed ones missed) are in ``docs/workflows.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .distribution import ScoreDistribution, expected_maximum
from .row_norms import block_norms

__all__ = ["MEMORISED_BELOW", "STANDOUT_MARGIN", "Diagnosis", "diagnose", "gradient_ratio"]

MEMORISED_BELOW = 0.1
"""A gradient ratio below this: the training set is memorised (training gradients 10x smaller than the queries')."""

STANDOUT_MARGIN = 0.5
"""A top-1 less than this many standard deviations above what noise's top reaches does not stand out."""

_SAMPLE = 4096  # rows whose norms are measured (evenly spaced over a larger store)


@dataclass(frozen=True)
class Diagnosis:
    """What the diagnostics found for one set of scores.

    rows: training rows the scores cover. noise: :func:`expected_maximum` of ``rows``.
    standout: per query, ``(top-1 - mean) / std`` of its scores (None: no distribution recorded, e.g. an index
        shortlist). flat: the query ids whose top-1 does not stand out of noise.
    gradient_ratio: per member (one entry for a single model), median training-row norm / median query norm
        (None where not measured).
    warnings: one line each, naming the fix.
    """

    rows: int
    noise: float
    standout: list[float] | None
    flat: list[str]
    gradient_ratio: list[float | None] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    agreement: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields, and the printed ``lines`` (what the report shows, which cannot import this module)."""
        return {**asdict(self), "lines": self.lines()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        return cls(**{k: data[k] for k in ("rows", "noise", "standout", "flat", "gradient_ratio", "warnings")},
                   agreement=data.get("agreement"))

    def lines(self) -> list[str]:
        """What to print: the measured values and the warnings."""
        out = []
        if self.standout is not None and self.standout:
            values = sorted(self.standout)
            median = values[len(values) // 2]
            out.append(f"top-1 standout: median {median:.1f} std above the mean (noise's top of {self.rows:,} rows: "
                       f"{self.noise:.1f}); {len(self.flat)} of {len(self.standout)} queries within noise")
        ratios = [r for r in self.gradient_ratio if r is not None]
        if ratios:
            shown = ", ".join(f"{r:.3g}" for r in self.gradient_ratio if r is not None)
            out.append(f"gradient ratio (median training / query norm): {shown}")
        if self.agreement and self.agreement.get("pairwise") is not None:
            line = f"members' top-{self.agreement['k']} overlap: {self.agreement['pairwise']:.2f} between members"
            if self.agreement.get("with_combined"):
                line += ", " + ", ".join(f"{v:.2f}" for v in self.agreement["with_combined"]) + " with the combined"
            out.append(line + " (Jaccard, mean over queries)")
        return out


def _norms(source: Any, limit: int = _SAMPLE) -> torch.Tensor:
    """Norms of up to ``limit`` rows of a gradient source, evenly spaced over it (float32, as the index keeps
    them: :func:`gradtrace.score.row_norms.block_norms`)."""
    count = len(source)
    if count == 0:
        return torch.zeros(0)
    if count <= limit or not hasattr(source, "rows"):
        rows = source.read(0, min(count, limit))
    else:
        index = torch.linspace(0, count - 1, limit).round().long().unique().tolist()
        rows = source.rows(index)
    return block_norms(rows)


def gradient_ratio(train: Any, queries: Any) -> float | None:
    """Median norm of ``train``'s rows over the median norm of ``queries``' (gradient sources with the same spec);
    None when either is empty or the queries' gradients are all zero."""
    train_norms, query_norms = _norms(train), _norms(queries)
    if len(train_norms) == 0 or len(query_norms) == 0:
        return None
    query_median = float(query_norms.median())
    return float(train_norms.median()) / query_median if query_median > 0 else None


def _top1(scores: Any) -> torch.Tensor | None:
    if scores.top is not None:
        return scores.top[0][:, 0].to(torch.float64)
    if scores.matrix is not None:
        return scores.matrix.max(dim=1).values.to(torch.float64)
    return None


def diagnose(scores: Any, *, train: Any | Sequence[Any] | None = None, queries: Any | Sequence[Any] | None = None,
             label: str = "the model") -> Diagnosis:
    """The :class:`Diagnosis` of ``scores`` (:class:`gradtrace.Scores`).

    Args:
        scores: scores with ``meta["distribution"]`` (recorded by the engine) or a full matrix.
        train, queries: the training and query gradient sources the scores came from (one each, or one per
            ensemble member, in the same order) for the gradient ratio; None: not measured.
        label: how the warning names the scored model (``"the final checkpoint"``).
    """
    distribution = scores.meta.get("distribution")
    if not distribution and scores.matrix is not None:
        distribution = ScoreDistribution.of_matrix(scores.matrix)
    top1 = _top1(scores)
    rows = int(distribution["rows"]) if distribution else len(scores.train_ids)
    noise = expected_maximum(rows)
    standout: list[float] | None = None
    flat: list[str] = []
    if distribution and top1 is not None and len(distribution["mean"]) == len(top1):
        mean = torch.tensor(distribution["mean"], dtype=torch.float64)
        std = torch.tensor(distribution["std"], dtype=torch.float64)
        z = torch.where(std > 0, (top1 - mean) / std.clamp_min(1e-300), torch.zeros_like(mean))
        standout = z.tolist()
        flat = [q for q, value in zip(scores.query_ids, standout) if value - noise < STANDOUT_MARGIN]
    ratios: list[float | None] = []
    if train is not None and queries is not None:
        trains = list(train) if isinstance(train, (list, tuple)) else [train]
        query_sets = list(queries) if isinstance(queries, (list, tuple)) else [queries]
        ratios = [gradient_ratio(t, q) for t, q in zip(trains, query_sets)]
    warnings = []
    memorised = [i for i, r in enumerate(ratios) if r is not None and r < MEMORISED_BELOW]
    if memorised and len(memorised) == len(ratios):
        smallest = min(ratios[i] for i in memorised)  # type: ignore[type-var]
        warnings.append(f"{label} has memorised its training set: its training examples' gradients are "
                        f"{1 / smallest:.0f}x smaller than the queries' (median norms), so single-model rankings "
                        "are unreliable; score the run's checkpoints instead (gradtrace collect --checkpoints-of "
                        "RUN_DIR, then score the ensemble it prints)")
    elif memorised:
        warnings.append(f"members {memorised} of the ensemble have memorised their training set (gradient ratio "
                        f"below {MEMORISED_BELOW}); the others carry the ranking")
    if standout is not None and standout and len(flat) * 2 > len(standout):
        fix = ("several checkpoints already: a finer projection (a higher --rank) or earlier checkpoints may help"
               if len(ratios) > 1 or scores.meta.get("agreement") else
               "a model trained far past convergence does this: score the run's checkpoints, gradtrace attribute "
               "RUN_DIR ... or gradtrace collect --checkpoints-of RUN_DIR")
        warnings.append(f"for {len(flat)} of {len(standout)} queries the top score stands out of the score "
                        f"distribution no more than the top of {rows:,} rows of noise would: no training example "
                        f"explains them clearly ({fix})")
    return Diagnosis(rows=rows, noise=noise, standout=standout, flat=flat, gradient_ratio=ratios,
                     warnings=warnings, agreement=scores.meta.get("agreement"))
