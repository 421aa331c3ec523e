"""Influence functions: ``tau(q, i) = g_q^T (G + lambda I)^-1 g_i`` with a block-diagonal curvature ``G``.

* ``kfac`` / ``ekfac`` -- Kronecker-factored curvature (George et al. 2018; Grosse et al. 2023), fitted with
  :func:`gradtrace.fit.curvature.fit_curvature` (``attr.fit(model, train_data, loss_fn)``), or loaded from a
  saved fit (``curvature="path"``). On a LoGra store they work in the projected space.
* ``ggn`` -- the dense Fisher / Gauss-Newton matrix of each parameter (exact for classifiers with
  ``fisher="exact"``): the reference the factored methods approximate; quadratic in parameter size.
* ``logra`` -- LoGra influence (Choe et al. 2024): the dense Fisher of the *projected* per-example gradients of
  each parameter, computed from the training store itself (no model pass).

The inverse is applied to the query side once; training gradients stay raw. Positive = helpful.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...common.checks import at_least, count
from ...common.checks import seed as seed_of
from ...store.spec import GradientSpec, SpecMismatch
from ..curvature import Curvature
from ..curvature.blocks import DenseBlock
from ..curvature.curvature import CurvatureError, DenseEigen, eigh
from ..curvature.fit import fit_curvature_from
from .base import Method, MissingStage, get_method, register_method

__all__ = ["KFAC", "EKFAC", "GGN", "LoGraInfluence", "CurvatureWeightsWarning", "curvature_method"]

_METHOD_OF_KIND = {"kfac": "kfac", "ekfac": "ekfac", "fisher": "ggn"}


def curvature_method(curvature: Curvature, **options: Any) -> Method:
    """The influence method that scores with ``curvature``: the one ``gradtrace fit`` recorded fitting it for (a
    ``logra`` fit is of kind ``"fisher"``), else the method of its kind (``kfac``, ``ekfac``, ``ggn`` for a dense
    Fisher, whose inverse is the same whichever of ``ggn`` / ``logra`` applies it)."""
    recorded = (curvature.meta.get("config") or {}).get("method")
    name = recorded if recorded in ("kfac", "ekfac", "ggn", "logra") else _METHOD_OF_KIND[curvature.kind]
    return get_method(name, curvature=curvature, **options)


class CurvatureWeightsWarning(UserWarning):
    """Curvature fitted at other model weights than the training gradients were taken at."""


class _CurvatureMethod(Method):
    needs = ("curvature",)
    curvature_kind: ClassVar[str] = ""  # the kind fit() makes
    curvature_kinds: ClassVar[tuple[str, ...]] = ()  # the kinds a loaded or given curvature may be
    default_fisher: ClassVar[str] = "auto"  # exact for classifiers with few classes, sampled labels for LMs

    def __init__(self, curvature: Curvature | str | Path | None = None, damping: float | None = None,
                 damping_mode: str | None = None, fisher: str | None = None, samples: int = 1, seed: int = 0,
                 max_dense: int = 4096) -> None:
        if damping is not None:  # checked here, not at the first score: the constructor is the edge
            at_least(damping, "damping", 0)
        if damping_mode not in (None, "relative", "absolute"):
            raise ValueError(f"damping_mode must be 'relative' or 'absolute', got {damping_mode!r}")
        count(samples, "samples")
        seed_of(seed)
        count(max_dense, "max_dense", minimum=0)
        if isinstance(curvature, (str, Path)):
            curvature = Curvature.load(curvature)
        if curvature is not None:
            self._check_kind(curvature)
        self.curvature = curvature
        self.damping = damping
        self.damping_mode = damping_mode
        self.fisher = fisher or self.default_fisher
        self.fit_options = {"samples": samples, "seed": seed, "max_dense": max_dense}

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None, *,
            projection: Any = None, **options: Any) -> None:
        """Fit the curvature for the training gradients' spec (pass ``projection=`` for PCA-projected ones)."""
        if projection is not None:
            options["projection"] = projection
        if model is None or data is None:
            raise MissingStage(f"{self.name}: fit(model, train_data, loss_fn) needs the model and training data")
        settings = {**self.fit_options, **options, "kind": self.curvature_kind, "fisher": self.fisher}
        self.curvature = fit_curvature_from(model, data, loss_fn, attributor.spec, settings)

    def check_ready(self) -> None:
        if self.curvature is None:
            raise MissingStage(f"{self.name} needs curvature: run attr.fit(model, train_data, loss_fn) first, or pass "
                               f"Attributor('{self.name}', train, curvature=<saved curvature directory>)")

    def bind(self, spec: GradientSpec) -> None:
        """Refuse curvature fitted for other gradients (another model, projection or parameter set, a block
        list that does not cover them exactly) or of another kind; warn when it was fitted at other weights."""
        self.check_ready()
        self._check_kind(self.curvature)
        mine = self.curvature.spec
        if mine.model.get("arch") and spec.model.get("arch") and mine.model["arch"] != spec.model["arch"]:
            raise SpecMismatch(f"{self.name}: the curvature was fitted on another model ({mine.model.get('class')})")
        if mine.projection != spec.projection:
            raise SpecMismatch(f"{self.name}: the curvature was fitted with projection {mine.projection}, the "
                               f"gradients use {spec.projection}")
        if mine.params != spec.params:
            names = {n for n, _ in mine.params}
            theirs = {n for n, _ in spec.params}
            raise SpecMismatch(f"{self.name}: the curvature covers other parameters than the gradients "
                               f"({len(mine.params)} vs {len(spec.params)}; only the curvature's: "
                               f"{sorted(names - theirs)[:5]}, only the gradients': {sorted(theirs - names)[:5]}); "
                               "fit it with the same layers")
        self.curvature.check_covers(spec, self.name)
        if mine.model.get("weights") and spec.model.get("weights") and mine.model["weights"] != spec.model["weights"]:
            warnings.warn(f"{self.name}: the curvature was fitted at other weights ({mine.model['weights']}) than the "
                          f"training gradients' model ({spec.model['weights']}); fit it at the weights the gradients "
                          "were taken at", CurvatureWeightsWarning, stacklevel=3)

    def _check_kind(self, curvature: Curvature) -> None:
        if curvature.kind not in self.curvature_kinds:
            raise CurvatureError(f"{self.name}: the curvature is a {curvature.kind!r} fit; {self.name} uses "
                                 f"{' or '.join(repr(k) for k in self.curvature_kinds)} curvature: use it with method "
                                 f"{_METHOD_OF_KIND.get(curvature.kind, '?')!r}, or fit {self.name} curvature")

    def active(self) -> Curvature:
        curvature = self.curvature
        if self.damping is not None or self.damping_mode is not None:
            curvature = curvature.with_damping(self.damping if self.damping is not None else curvature.damping,
                                               self.damping_mode)
        return curvature

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        self.check_ready()
        return self.active().apply_inverse(queries)

    def options(self) -> dict[str, Any]:
        curvature = self.active() if self.curvature is not None else None
        return {"fisher": self.fisher if curvature is None else curvature.fisher,
                "damping": None if curvature is None else curvature.damping,
                "damping_mode": None if curvature is None else curvature.damping_mode,
                "kind": self.curvature_kind}


@register_method
class KFAC(_CurvatureMethod):
    name = "kfac"
    curvature_kind = "kfac"
    curvature_kinds = ("kfac",)
    description = "K-FAC influence: Kronecker-factored Fisher, damped inverse on the query side"


@register_method
class EKFAC(_CurvatureMethod):
    name = "ekfac"
    curvature_kind = "ekfac"
    curvature_kinds = ("ekfac",)
    description = "EK-FAC influence: K-FAC eigenbasis with corrected eigenvalues"


@register_method
class GGN(_CurvatureMethod):
    name = "ggn"
    curvature_kind = "fisher"
    curvature_kinds = ("fisher",)
    default_fisher = "exact"
    description = "dense per-parameter Gauss-Newton / Fisher influence (reference; small models)"

    def __init__(self, *args: Any, max_dense: int = 1 << 16, **kwargs: Any) -> None:
        super().__init__(*args, max_dense=max_dense, **kwargs)


@register_method
class LoGraInfluence(_CurvatureMethod):
    """LoGra influence: curvature in the LoGra-projected space.

    mode: ``"dense"`` -- the dense Fisher of each parameter's projected per-example gradients, from the training
        store (LoGra's "raw" mode, LogIX's default; no model pass; its estimate from ``N`` examples has rank at most
        ``N``); ``"ekfac"`` / ``"kfac"`` -- Kronecker factors of the projected activations and output-gradients
        (fitted with a model pass over the data: ``k x k`` factors estimated from every token). ``"auto"``
        (default): ``"dense"`` when the store holds at least as many examples as the largest projected parameter
        has dimensions (every block's estimate can be full rank) and every block fits ``max_dense``, else
        ``"ekfac"`` when ``fit`` gets a model and data (and ``"dense"`` without them); a ``fisher`` other than
        ``"auto"`` / ``"empirical"`` asks for a model pass, so ``"ekfac"``. The choice made is :attr:`mode_used`.
    fisher: in the model-pass modes as for kfac/ekfac (default ``"auto"``); ``"dense"`` is the empirical Fisher of
        the stored gradients, and refuses any other choice.
    """

    name = "logra"
    curvature_kind = "fisher"
    curvature_kinds = ("fisher", "kfac", "ekfac")  # mode dense, kfac, ekfac
    default_fisher = "auto"  # the model-pass modes, as kfac/ekfac; "dense" is the stored gradients' empirical Fisher
    description = "LoGra influence: curvature of the projected gradients (EK-FAC in the projected space, or dense)"

    def __init__(self, *args: Any, mode: str = "auto", **kwargs: Any) -> None:
        if mode not in ("auto", "dense", "kfac", "ekfac"):
            raise ValueError(f"logra mode must be 'auto', 'dense', 'kfac' or 'ekfac', got {mode!r}")
        super().__init__(*args, **kwargs)
        self.mode = mode
        self.mode_used: str | None = None

    def options(self) -> dict[str, Any]:
        return {**super().options(), "mode": self.mode, "mode_used": self.mode_used}

    def resolve_mode(self, examples: int, spec: GradientSpec, has_data: bool, max_dense: int) -> str:
        """The mode ``"auto"`` means for ``examples`` stored training gradients of ``spec`` (see the class doc)."""
        if self.mode != "auto":
            return self.mode
        if not has_data:
            return "dense"
        if self.fisher not in ("auto", "empirical"):
            return "ekfac"
        largest = max(dim for _, dim in spec.params)
        return "dense" if largest <= max_dense and examples >= largest else "ekfac"

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None, *,
            projection: Any = None, **options: Any) -> None:
        spec = attributor.spec
        if projection is not None:
            options["projection"] = projection
        if spec.projection is None:
            raise ValueError("logra influence works in a projected space: collect the training gradients with "
                             "options=CaptureOptions(projection=gradtrace.LoGra(...))")
        max_dense = options.get("max_dense", self.fit_options["max_dense"])
        mode = self.resolve_mode(len(attributor.train[0]), spec, model is not None and data is not None, max_dense)
        self.mode_used = mode
        if mode in ("kfac", "ekfac"):
            if model is None or data is None:
                raise MissingStage(f"logra mode {mode!r}: fit(model, train_data, loss_fn) needs the model and data")
            self.curvature = fit_curvature_from(model, data, loss_fn, spec,
                                                {**self.fit_options, **options, "kind": mode, "fisher": self.fisher})
            return
        if self.fisher not in ("auto", "empirical"):
            raise ValueError(f"logra mode 'dense' takes the Fisher of the stored gradients (the empirical Fisher); "
                             f"fisher={self.fisher!r} needs mode='ekfac' or 'kfac' with fit(model, train_data, "
                             "loss_fn)")
        self._fit_dense(attributor, spec, options)

    def _fit_dense(self, attributor: Any, spec: GradientSpec, options: dict[str, Any]) -> None:
        """Accumulate ``F_p = mean_i g_ip g_ip^T`` per parameter over the stored training gradients."""
        max_dense = options.get("max_dense", self.fit_options["max_dense"])
        offsets = spec.offsets()
        totals = {name: None for name, _ in spec.params}
        source = attributor.train[0]
        count = 0
        for _, block in source.iter_blocks(attributor.block_rows, attributor.device):
            count += block.shape[0]
            for name, (start, stop) in offsets.items():
                part = block[:, start:stop].to(torch.float32)
                value = part.pow(2).sum(0) if stop - start > max_dense else part.t() @ part
                totals[name] = value if totals[name] is None else totals[name] + value
        if count == 0:
            raise ValueError("logra: the training store is empty")
        blocks = {}
        for name, dim in spec.params:
            moment = totals[name] / count
            if moment.dim() == 1:
                blocks[name] = DenseEigen(DenseBlock(name, dim, True), None, moment.cpu())
            else:
                values, vectors = eigh(moment.cpu())
                blocks[name] = DenseEigen(DenseBlock(name, dim), vectors, values)
        self.curvature = Curvature("fisher", spec, blocks, "empirical", 0.1, "relative",
                                   {"examples": count, "source": "training store"})
