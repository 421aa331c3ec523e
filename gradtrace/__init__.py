"""gradtrace: training data attribution for language models.

Which training examples made my model do this? ``gradtrace.capture`` records per-example gradients from an
unmodified training loop (or ``gradtrace.collect`` from a dataset at fixed weights), a ``GradientStore``
keeps them on disk, and an ``Attributor`` scores queries against them.

Sign convention everywhere: a positive score means the training example helps the query (lowers its loss).

The names below are resolved on first use (:func:`__getattr__`), so that ``import gradtrace`` -- and the command
line's ``gradtrace --help`` -- do not import torch; ``gradtrace.capture`` and ``gradtrace.plan`` are the functions,
as they always were, although packages of those names exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from .version import __version__

_EXPORTS: dict[str, tuple[str, str]] = {
    # name: (module, attribute)
    "capture": (".capture", "capture"), "Capture": (".capture", "Capture"),
    "CaptureCallback": (".capture", "CaptureCallback"), "CaptureReport": (".capture", "CaptureReport"),
    "collect_checkpoints": (".capture.checkpoints", "collect_checkpoints"),
    "collect": (".capture.collect", "collect"), "GradientSet": (".capture.gradient_set", "GradientSet"),
    "StoreWriter": (".capture.sink", "StoreWriter"),
    "GradientBatch": (".grad", "GradientBatch"), "ParamGradient": (".grad", "ParamGradient"),
    "Loss": (".options", "Loss"), "CaptureOptions": (".options", "CaptureOptions"),
    "StoreOptions": (".options", "StoreOptions"), "FitOptions": (".options", "FitOptions"),
    "RunOptions": (".options", "RunOptions"),
    "available_methods": (".fit.methods", "available_methods"),
    "data_value_embeddings": (".fit.methods.dvemb", "data_value_embeddings"),
    "less_features": (".fit.methods.less", "less_features"),
    "less_query_features": (".fit.methods.less", "less_query_features"),
    "load_fit": (".fit.methods.saved", "load_fit"), "save_fit": (".fit.methods.saved", "save_fit"),
    "FitPlan": (".plan", "FitPlan"), "Plan": (".plan", "Plan"), "ScorePlan": (".plan", "ScorePlan"),
    "plan": (".plan", "plan"), "plan_fit": (".plan", "plan_fit"), "plan_score": (".plan", "plan_score"),
    "LoGra": (".projection", "LoGra"),
    "Attributor": (".score", "Attributor"), "Ensemble": (".score", "Ensemble"), "Scores": (".score", "Scores"),
    "Unrolled": (".score", "Unrolled"),
    "GradientSpec": (".store", "GradientSpec"), "GradientStore": (".store", "GradientStore"),
    "TrajectoryWriter": (".train", "TrajectoryWriter"),
}

__all__ = [
    "capture", "Capture", "CaptureCallback", "CaptureReport", "collect", "GradientBatch", "ParamGradient", "LoGra",
    "Loss", "CaptureOptions", "StoreOptions", "FitOptions", "RunOptions", "GradientSet", "GradientStore",
    "GradientSpec", "StoreWriter", "Attributor", "Scores",
    "available_methods", "less_features", "less_query_features", "data_value_embeddings", "TrajectoryWriter",
    "plan", "Plan", "plan_fit", "FitPlan", "plan_score", "ScorePlan", "__version__", "Ensemble", "Unrolled",
    "collect_checkpoints", "load_fit", "save_fit",
]


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use and kept), else a subpackage such as
    ``gradtrace.score`` (imported on first use, as the eager package used to have them all)."""
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module, __name__), attribute)
        if name == "LoGra":  # LoGra.pca fits its basis with the curvature stage, which registers itself on import
            importlib.import_module(".fit.curvature.pca", __name__)
        types.ModuleType.__setattr__(sys.modules[__name__], name, value)
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Facade(types.ModuleType):
    """The package module: importing the ``capture`` or ``plan`` package sets ``gradtrace.capture`` /
    ``gradtrace.plan`` to the package; the public name is the function, so that assignment is left out."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name, ("", ""))[1] == name and \
                value.__name__ == f"{__name__}{_EXPORTS[name][0]}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
