"""Pre-flight plans: what ``collect``, ``fit`` and ``score`` will take, before they run.

* :func:`plan` (``gradtrace collect``): counts the examples and tokens of ``data``, runs a short timed warm-up
  (the first batches, in memory) to learn the captured parameters and the dimension of each example's vector,
  and compares the store's expected size with the free space where it will be written.
* :func:`plan_fit` (``gradtrace fit``): the examples and passes of the fit, the curvature's blocks, factor
  sizes and saved size (from a timed warm-up fit on the first batches: the same blocks as the full fit), against
  the free space where it is saved.
* :func:`plan_score` (``gradtrace score``): the store's rows and dims, the blocks streamed, the memory scoring
  holds (block buffer, prepared queries, top-k state, the ``[Q, N]`` matrix when kept) against the memory
  available, the output's size, and the time from a timed first block.

The commands print these plans before the work, refuse what cannot fit (unless ``--force``), and ``--dry-run``
prints only them; this package computes (one module per plan; ``resources.py``: free disk and memory), the CLI
prints (:mod:`gradtrace.cli.preflight`).
"""

from .collect_plan import RECORD_BYTES_PER_ROW, Plan, plan
from .fit_plan import WARMUP_BATCHES, FitPlan, plan_fit
from .score_plan import ScorePlan, plan_score

__all__ = ["FitPlan", "Plan", "RECORD_BYTES_PER_ROW", "ScorePlan", "WARMUP_BATCHES", "plan", "plan_fit", "plan_score"]
