"""How metagradients replay a recorded run: where the reverse pass starts, checkpoint spacing, queries per reverse
pass, memory, the replay check's bound, and the metasmoothness check's perturbations."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields


@dataclass(frozen=True, kw_only=True)
class MetagradOptions:
    """Settings of :func:`gradtrace.replay.metagradients` and :func:`gradtrace.replay.metasmoothness`.

    Attributes:
        start_step: the first optimizer step the reverse pass differentiates (0: the whole run, the exact
            derivative). With ``K > 0`` the pass is truncated (truncated back-propagation, Shaban et al. 2019): the
            weights count only at steps ``K .. T-1`` and the state after step ``K - 1`` is taken as given, so an
            example scores what its steps from ``K`` on did; one seen only before ``K`` scores 0. For runs that are
            not metasmooth, where the derivative through the early steps is dominated by how the run's chaos
            amplifies them; it costs ``(T - K) / T`` of the reverse pass.
        checkpoint_every: optimizer steps between state checkpoints (None: ``ceil(sqrt(T - K))``, ``T / k + k`` states
            in memory; the scores do not depend on it).
        query_batch: queries per reverse pass (None: all, one vectorised pass; 1: one plain pass per query).
        memory_limit: bytes of checkpoints kept in memory; the rest are written under the run directory (removed
            at the end).
        tolerance: the replay check's bound on the relative max-abs difference to the recorded final weights (None:
            1e-9 in float64, 1e-4 in float32).
        scales: the perturbation sizes ``eps`` of the metasmoothness check (re-runs with weights ``1 + eps d``).
        seed: the seed of the check's random directions ``d``.
    """

    start_step: int = field(default=0, metadata={"min": 0, "help": (
        "First optimizer step the reverse pass differentiates (default 0: the whole run, exact). K > 0 truncates it: "
        "the examples' weights count at steps K..T-1 only and the state before step K is taken as given (for runs "
        "that are not metasmooth; costs (T-K)/T of the pass).")})
    checkpoint_every: int | None = field(default=None, metadata={"min": 1, "help": (
        "Optimizer steps between state checkpoints (default: ceil(sqrt(T - start_step)), T/k + k states in memory; "
        "the scores do not depend on it).")})
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
