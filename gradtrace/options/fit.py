"""Which curvature is fitted, and how."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.checks import SEED, check_fields
from .base import _choice

CURVATURE_KINDS = ("kfac", "ekfac", "fisher")
FLOAT_DTYPES = ("float32", "float64")


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """Which curvature is fitted and how (see :func:`gradtrace.fit.curvature.fit_curvature`).

    Attributes:
        kind: ``"kfac"``, ``"ekfac"`` (eigenvalue-corrected) or ``"fisher"`` (a dense Fisher per parameter;
            exact but quadratic in the parameter size -- the reference for small models).
        fisher: ``"empirical"``, ``"true"`` (``samples`` label draws per example), ``"exact"`` or ``"auto"``
            (exact for classifiers / regressors with few outputs, else true: see
            :func:`gradtrace.fit.curvature.fisher.resolve_fisher`); the choice made is the curvature's ``fisher``.
        samples, seed: label draws per example for ``fisher="true"`` (>= 1), and their seed (a 64-bit integer).
        max_dense: dense blocks larger than this are kept diagonal (>= 0; 0: every block diagonal).
        damping, damping_mode: stored defaults (changeable later with ``Curvature.with_damping``); damping is a finite
            number >= 0 (0: undamped, refused when the curvature is used if it is singular).
        join_bias: join a module's bias to its weight's Kronecker block (K-FAC's ``[a; 1]``); False keeps
            biases as dense blocks (pure weight factors, as a PCA projection basis needs).
        covariance_dtype: ``"float32"`` or ``"float64"``: the dtype the statistics are formed and summed in (the
            Kronecker factors' sums of outer products, the dense Fisher blocks, the EK-FAC second moments in the
            eigenbasis), whatever the model's dtype. float64 costs about 2x the memory of the sums (and on most GPUs
            many times the time of their products).
        eigen_dtype: ``"float64"`` or ``"float32"``: the dtype of the eigendecompositions (the eigendata is kept in
            float32 either way). float32 is faster on GPUs but loses the small eigenvalues of ill-conditioned factors.
        offload: keep the running sums on the CPU while the batches run on ``RunOptions.device``: each batch's
            contribution is computed on the device and added into CPU buffers (device memory holds one batch's
            statistics, not every block's sums; costs one device-to-host copy per block per batch). With the model
            on the CPU the results are identical.
    """

    kind: str = "ekfac"
    fisher: str = "empirical"
    samples: int = field(default=1, metadata={"min": 1})
    seed: int = field(default=0, metadata={"valid": SEED})
    max_dense: int = field(default=4096, metadata={"min": 0})
    damping: float = field(default=0.1, metadata={"min": 0})
    damping_mode: str = "relative"
    join_bias: bool = True
    covariance_dtype: str = "float32"
    eigen_dtype: str = "float64"
    offload: bool = False

    def __post_init__(self) -> None:
        _choice(self.kind, "kind", CURVATURE_KINDS)
        _choice(self.covariance_dtype, "covariance_dtype", FLOAT_DTYPES)
        _choice(self.eigen_dtype, "eigen_dtype", FLOAT_DTYPES)
        _choice(self.damping_mode, "damping_mode", ("relative", "absolute"))
        check_fields(self)
