"""A fitted method saved to disk and loaded back: the state ``fit()`` computes for methods that keep it outside a
:class:`~gradtrace.fit.curvature.Curvature` (``trak``'s kernel, ``trackstar``'s second moment and preconditioner).

Curvature methods (``kfac``, ``ekfac``, ``ggn``, ``logra``) save their curvature (``Curvature.save``,
``curvature.json``). The other methods with a fit stage save through this module, in the same checksummed
layout (:func:`gradtrace.store.artifact.write_artifact`)::

    DIR/
      fit.json                    format, version, the method's name, its options, the spec of the gradients it
                                  was fitted for, its own fields, "meta" (provenance), checksums
      fit-<16 hex>.safetensors    its tensors
      precondition/               trackstar preconditioned by a curvature method: that curvature (curvature.json)

So a fit made once (``gradtrace fit STORE --method trak``) serves every scoring of that store, on the command line
(``gradtrace score --method trak --fit DIR``) and in Python (``Attributor(load_fit(DIR), store)``). A load
verifies the checksums, that the tensors have the shapes the spec implies and are finite, and refuses a fit of
another method; scoring then refuses a fit made for other gradients (``Method.bind``), as for a curvature. A dual
TRAK fit (the Gram matrix of its training rows) records the store it reads, by path and fingerprint.

A method takes part by implementing :meth:`Method.fit_state` (its fields and tensors) and
:meth:`Method.from_fit_state` (the inverse, with its checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...store.artifact import ArtifactExists, read_artifact, write_artifact
from ...store.locking import directory_lock
from ...store.spec import GradientSpec
from .base import Method, available_methods, method_class

__all__ = ["FORMAT", "VERSION", "FitError", "check_tensor", "is_saved_fit", "load_fit", "refuse_unused", "save_fit",
           "saves_fit"]

FORMAT = "gradtrace-method-fit"
VERSION = 2
"""2 from the first release: checksummed like the version-2 curvature and scores (1 is the artifacts' unchecked
legacy version, never written for fits)."""
STEM = "fit"


class FitError(ValueError):
    """A saved method fit is missing, corrupted, of another method or does not match its gradients."""


def saves_fit(method: str | Method) -> bool:
    """Whether ``method`` (a name or an instance) saves its fit through this module."""
    cls = type(method) if isinstance(method, Method) else method_class(method)
    return cls.fit_state is not Method.fit_state


def is_saved_fit(path: str | Path) -> bool:
    """Whether ``path`` holds a saved method fit (``fit.json``)."""
    return (Path(path) / f"{STEM}.json").is_file()


def save_fit(method: Any, path: str | Path, meta: dict[str, Any] | None = None, *, overwrite: bool = False) -> Path:
    """Save the fitted state of ``method`` (a :class:`Method` or an :class:`~gradtrace.Attributor`) in directory
    ``path``; returns ``path``. Written atomically: a failed save leaves a previous fit there intact -- except that
    trackstar's curvature preconditioner is written first, into ``path/precondition``: a save failing after it
    leaves the previous fit refused on load (the preconditioner's checksum no longer matches), never mixed. A fit
    already saved in ``path`` is replaced only with ``overwrite``; the save holds the directory's write lock.

    Raises :class:`MissingStage` when the method has not been fitted, and :class:`TypeError` for a method whose
    state lives elsewhere (a curvature method: ``attr.method.curvature.save(path)``) or that has none.
    """
    method = getattr(method, "method", method)
    if not isinstance(method, Method):
        raise TypeError(f"save_fit() takes a fitted method or Attributor, got {type(method).__name__}")
    if not saves_fit(method):
        hint = (f"save its curvature: attr.method.curvature.save({str(path)!r})" if "curvature" in method.needs else
                "it has no fitted state to save")
        raise TypeError(f"method {method.name!r} is not saved with save_fit(): {hint}")
    method.check_ready()
    with directory_lock(path, "a method fit"):
        if not overwrite and (Path(path) / f"{STEM}.json").exists():
            raise ArtifactExists(f"{path} already holds a saved method fit: pass overwrite=True (--overwrite) to "
                                 "replace it")
        fields, tensors = method.fit_state(Path(path))
        info = {"method": method.name, **fields, "meta": dict(meta or {})}
        write_artifact(path, STEM, FORMAT, VERSION, info, tensors, what="method fit")
    return Path(path)


def load_fit(path: str | Path, method: str | None = None, **overrides: Any) -> Method:
    """The fitted method saved in ``path`` by :func:`save_fit`, ready to score (``Attributor(load_fit(path),
    store)``). ``method``: refuse a fit of any other method. ``overrides``: settings applied without refitting
    (``damping=``, ``damping_mode=``: see the method's :meth:`~Method.from_fit_state`).

    Raises :class:`FitError` naming the file for a missing, corrupted or edited fit, one of another method, or
    tensors that do not match the recorded gradients.
    """
    path = Path(path)
    if not is_saved_fit(path):
        found = "a fitted curvature (curvature.json)" if (path / "curvature.json").exists() else "no fit.json"
        raise FitError(f"{path} holds no saved method fit ({found}); fit it with gradtrace fit STORE --method "
                       f"{method or 'trak'} --out {path} (Python: gradtrace.fit.methods.save_fit(attr, path))")
    info, tensors = read_artifact(path, STEM, FORMAT, VERSION, what="method fit", error=FitError)
    name = info.get("method")
    if name not in available_methods():
        raise FitError(f"{path / 'fit.json'} is a fit of unknown method {name!r}")
    if method is not None and name != method:
        raise FitError(f"{path} holds a {name} fit, not a {method} one: fit {method} (gradtrace fit STORE --method "
                       f"{method}) or score with --method {name}")
    cls = method_class(name)
    try:
        spec = GradientSpec.from_dict(info["spec"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise FitError(f"{path / 'fit.json'} is malformed ({err!r}); fit again") from None
    loaded = cls.from_fit_state(info, tensors, spec, path, **overrides)
    loaded.meta = dict(info.get("meta") or {})
    return loaded


def check_tensor(tensors: dict[str, Tensor], key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 path: Path) -> Tensor:
    """``tensors[key]``, refused (:class:`FitError` naming ``path``) when missing, of another shape or dtype, or not
    finite."""
    value = tensors.get(key)
    if value is None:
        raise FitError(f"{path}: the fit lacks its {key!r} tensor; fit again")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise FitError(f"{path}: {key} is {value.dtype} {tuple(value.shape)}, expected {dtype} {tuple(shape)} for "
                       "the recorded gradients; fit again")
    if not bool(torch.isfinite(value).all()):
        raise FitError(f"{path}: {key} holds NaN/inf (a corrupted file); fit again")
    return value


def refuse_unused(tensors: dict[str, Tensor], used: set[str], path: Path) -> None:
    """A fit holding tensors its method does not read was edited: refused."""
    unused = sorted(set(tensors) - used)
    if unused:
        raise FitError(f"{path}: the fit holds tensors its method does not use ({unused[:3]}); fit again")
