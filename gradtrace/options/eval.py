"""How the retraining ground truth of attribution quality is drawn and built."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields


@dataclass(frozen=True, kw_only=True)
class LDSOptions:
    """How the LDS ground truth is drawn and built (see :func:`gradtrace.eval.build_lds_ground_truth`).

    Attributes:
        num_subsets: ``S``, how many random subsets are retrained on (>= 1).
        fraction: each subset holds exactly ``round(fraction * N)`` of the ``N`` training examples (in (0, 1];
            the subset must be neither empty nor everything).
        seed: seeds the subset draws and the training seeds (a 64-bit integer): run ``r`` of every subset trains
            with seed ``seed + r``.
        runs: models trained per subset (>= 1); their outcomes are averaged.
        seed_per_subset: give run ``r`` of subset ``s`` the training seed ``seed + s * runs + r`` instead of sharing
            the seeds between subsets.
        subset_seed: draw the subsets from this seed instead of ``seed`` (training seeds unchanged): another ground
            truth of the same question on other subsets, e.g. to confirm on fresh subsets what was chosen looking at
            the first.
        save_every_s: while building into a cache, save progress at most this often (seconds, >= 0).
        progress: show a progress bar.
    """

    num_subsets: int = field(default=100, metadata={"min": 1})
    fraction: float = field(default=0.5, metadata={"min": 0, "min_open": True, "max": 1})
    seed: int = field(default=0, metadata={"valid": SEED})
    runs: int = field(default=1, metadata={"min": 1})
    seed_per_subset: bool = False
    subset_seed: int | None = field(default=None, metadata={"valid": SEED})
    save_every_s: float = field(default=30.0, metadata={"min": 0})
    progress: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
