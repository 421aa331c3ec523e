"""Which curvature is fitted, and how."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields
from .base import _choice

CURVATURE_KINDS = ("kfac", "ekfac", "fisher")


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """Which curvature is fitted and how (see :func:`gradtrace.curvature.fit_curvature`).

    Attributes:
        kind: ``"kfac"``, ``"ekfac"`` (eigenvalue-corrected) or ``"fisher"`` (a dense Fisher per parameter;
            exact but quadratic in the parameter size -- the reference for small models).
        fisher: ``"empirical"``, ``"true"`` (``samples`` label draws per example), ``"exact"`` or ``"auto"``
            (exact for classifiers / regressors with few outputs, else true: see
            :func:`gradtrace.curvature.fisher.resolve_fisher`); the choice made is the curvature's ``fisher``.
        samples, seed: label draws per example for ``fisher="true"`` (>= 1), and their seed (a 64-bit integer).
        max_dense: dense blocks larger than this are kept diagonal (>= 0; 0: every block diagonal).
        damping, damping_mode: stored defaults (changeable later with ``Curvature.with_damping``); damping is a finite
            number >= 0 (0: undamped, refused when the curvature is used if it is singular).
        join_bias: join a module's bias to its weight's Kronecker block (K-FAC's ``[a; 1]``); False keeps
            biases as dense blocks (pure weight factors, as a PCA projection basis needs).
    """

    kind: str = "ekfac"
    fisher: str = "empirical"
    samples: int = field(default=1, metadata={"min": 1})
    seed: int = field(default=0, metadata={"valid": SEED})
    max_dense: int = field(default=4096, metadata={"min": 0})
    damping: float = field(default=0.1, metadata={"min": 0})
    damping_mode: str = "relative"
    join_bias: bool = True

    def __post_init__(self) -> None:
        _choice(self.kind, "kind", CURVATURE_KINDS)
        _choice(self.damping_mode, "damping_mode", ("relative", "absolute"))
        check_fields(self)
