"""The ``--method`` choices of the command line, with the one-line description each method class declares.

Held here as text so that building the commands (``gradtrace --help``) does not import the methods, which import
torch; ``tests/cli/test_cli_polish.py`` checks that they are the registry's names and descriptions.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CLI_METHODS", "MethodName", "PYTHON_METHODS", "method_help"]

CLI_METHODS: dict[str, str] = {
    "grad_dot": "gradient inner product (positive = the training example lowers the query loss)",
    "grad_cos": "gradient cosine similarity in [-1, 1] (positive = helpful)",
    "tracin": "learning-rate weighted gradient inner products summed over checkpoints (positive = helpful)",
    "kfac": "K-FAC influence: Kronecker-factored Fisher, damped inverse on the query side",
    "ekfac": "EK-FAC influence: K-FAC eigenbasis with corrected eigenvalues",
    "ggn": "dense per-parameter Gauss-Newton / Fisher influence (reference; small models)",
    "logra": "LoGra influence: curvature of the projected gradients (EK-FAC in the projected space, or dense)",
    "trak": "TRAK: projected features, (Phi^T Phi + lambda I)^-1 on the query side, 1 - p weights (classifiers)",
    "trackstar": "TrackStar: Adam second-moment normalisation, optional curvature, unit-normalised (cosine)",
}
"""The methods the command line runs end to end (their stages: none, learning rates, or ``gradtrace fit``) and
their descriptions (``Method.description``)."""

PYTHON_METHODS = ("arnoldi", "cg", "dvemb", "ggn_full", "less")
"""The other registered methods: fitted from a model and data in Python."""

MethodName = Literal[tuple(CLI_METHODS)]  # type: ignore[valid-type]


def method_help() -> str:
    """The ``--method`` help: each method with its description, then the Python-only ones."""
    parts = "; ".join(f"{name} ({description})" for name, description in CLI_METHODS.items())
    return (f"Attribution method: {parts}. Others ({', '.join(PYTHON_METHODS)}) are fitted from a model and data "
            "with the Python API (gradtrace.Attributor).")
