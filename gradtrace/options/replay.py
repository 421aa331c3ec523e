"""How metagradients replay a recorded run: checkpoint spacing, queries per reverse pass, memory, the replay
check's bound, and the metasmoothness check's perturbations."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields


@dataclass(frozen=True, kw_only=True)
class MetagradOptions:
    """Settings of :func:`gradtrace.replay.metagradients` and :func:`gradtrace.replay.metasmoothness`.

    Attributes:
        checkpoint_every: optimizer steps between state checkpoints (None: ``ceil(sqrt(T))``, ``T / k + k`` states
            in memory; the scores do not depend on it).
        query_batch: queries per reverse pass (None: all, one vectorised pass; 1: one plain pass per query).
        memory_limit: bytes of checkpoints kept in memory; the rest are written under the run directory (removed
            at the end).
        tolerance: the replay check's bound on the relative max-abs difference to the recorded final weights (None:
            1e-9 in float64, 1e-4 in float32).
        scales: the perturbation sizes ``eps`` of the metasmoothness check (re-runs with weights ``1 + eps d``).
        seed: the seed of the check's random directions ``d``.
    """

    checkpoint_every: int | None = field(default=None, metadata={"min": 1, "help": (
        "Optimizer steps between state checkpoints (default: ceil(sqrt(T)), T/k + k states in memory; the scores do "
        "not depend on it).")})
    query_batch: int | None = field(default=None, metadata={"min": 1, "help": (
        "Queries per reverse pass (default: all, one vectorised pass; 1: one plain pass per query, least memory).")})
    memory_limit: int = field(default=2 << 30, metadata={"min": 0, "help": (
        "Bytes of checkpoints kept in memory; the rest are written under the run directory and removed at the end.")})
    tolerance: float | None = field(default=None, metadata={"min": 0, "help": (
        "Bound on the replay's relative max-abs difference to the recorded final weights; beyond it nothing is "
        "scored (default: 1e-4 for a float32 run, 1e-9 for a float64 run replayed in float64).")})
    scales: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
    seed: int = field(default=0, metadata={"valid": SEED})

    def __post_init__(self) -> None:
        object.__setattr__(self, "scales", tuple(float(s) for s in self.scales))
        if not self.scales or any(not s > 0 for s in self.scales):
            raise ValueError(f"MetagradOptions.scales must be positive numbers, got {self.scales!r}")
        check_fields(self)
