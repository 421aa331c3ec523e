"""The fitted method of ``gradtrace score``: what ``gradtrace fit`` saved, one per store (``--curvature`` for STORE,
``--member-curvature`` for each further ``--store`` of an ensemble).

Curvature methods (``kfac``, ``ekfac``, ``ggn``, ``logra``) read a curvature (``curvature.json``), ``trak`` and
``trackstar`` a method fit (``fit.json``, :mod:`gradtrace.fit.methods.saved`); ``--damping`` / ``--damping-mode``
change the saved damping without refitting. Methods with nothing to fit refuse these flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CliError

__all__ = ["fit_file", "fitted_methods", "load_fitted", "needs_fit"]


def needs_fit(method: str) -> bool:
    """Whether ``method`` scores from what ``gradtrace fit`` saved (a curvature or a method fit)."""
    from ..fit.methods import method_class, saves_fit

    return "curvature" in method_class(method).needs or saves_fit(method)


def fit_file(method: str) -> str:
    """The manifest ``gradtrace fit --method METHOD`` writes: ``fit.json`` or ``curvature.json``."""
    from ..fit.methods import saves_fit

    return "fit.json" if saves_fit(method) else "curvature.json"


def fitted_methods(sc: Any, store: Path, ensemble: Any) -> list[Any]:
    """One fitted method per store of ``gradtrace score``, loaded from ``sc.curvature`` and
    ``ensemble.member_curvature`` (empty for a method without a fit, which refuses ``--curvature`` / ``--damping``)."""
    return load_fitted(sc.method, sc.curvature, list(ensemble.member_curvature), store, damping=sc.damping,
                       damping_mode=sc.damping_mode)


def load_fitted(method: str, curvature: Path | None, members: list[Path], store: Path, *,
                damping: float | None = None, damping_mode: str | None = None) -> list[Any]:
    """``method`` loaded from what ``gradtrace fit`` saved in ``curvature`` (and in each of ``members``, further
    stores' fits), re-damped when asked; [] for a method without a fit (which refuses a fit or a damping)."""
    from ..fit.methods import get_method, load_fit, saves_fit

    if not needs_fit(method):
        if curvature is not None or damping is not None or damping_mode is not None:
            raise CliError(f"--curvature/--damping apply to methods fitted with gradtrace fit (kfac, ekfac, ggn, "
                           f"logra, trak, trackstar), not {method}")
        return []
    if curvature is None:
        data = "" if saves_fit(method) else " TRAIN.jsonl"
        raise CliError(f"--method {method} needs its fit: run gradtrace fit {store}{data} --method {method} --out "
                       "FIT_DIR, then pass --curvature FIT_DIR")
    paths = [curvature, *members]
    for flag, path in zip(["--curvature", *["--member-curvature"] * len(members)], paths):
        if not (path / fit_file(method)).exists():
            other = "curvature.json" if fit_file(method) == "fit.json" else "fit.json"
            found = f"; it holds {other}, the fit of another method" if (path / other).exists() else ""
            raise CliError(f"{flag} {path} holds no {method} fit ({fit_file(method)} missing{found}): gradtrace fit "
                           f"STORE --method {method} --out {path}")
    try:
        if saves_fit(method):
            return [load_fit(path, method, damping=damping, damping_mode=damping_mode) for path in paths]
        return [get_method(method, curvature=path, damping=damping, damping_mode=damping_mode) for path in paths]
    except (ValueError, OSError) as err:
        raise CliError(str(err)) from None
