"""TrackStar (Chang et al. 2024, "Scalable influence and fact tracing for LLM pretraining").

A gradient ``g`` is divided coordinate by coordinate by the square root of Adam's second moment (the optimizer's
``exp_avg_sq`` at the attributed weights, bias-corrected as Adam's update does: ``v_hat = v / (1 - b2**t)``),
optionally preconditioned by a curvature ``R``, and unit-normalised; the score is a cosine::

    n = g / (sqrt(v_hat) + eps)
    tau(q, i) = n_q^T R^-1 n_i / (||n_q||_R ||n_i||_R),     ||x||_R = sqrt(x^T R^-1 x)   (R = I: plain cosine)

i.e. the cosine of ``R^-1/2 n_q`` and ``R^-1/2 n_i``, as TrackStar's unit-normalised ``R^-1/2``-corrected features.
The query side is preconditioned once (``R^-1 n_q / ||n_q||_R``); each block of training rows is divided by its
``v`` and by its own ``||n_i||_R`` (with ``R``: one preconditioning of every training row at score time).

**Projected stores.** Bergson and the paper normalise the gradient *before* the random projection (Bergson: Adam's
``exp_avg_sq`` reduced to Adafactor row and column means, applied to the activations and output gradients in the
hooks). gradtrace's stores keep raw gradients (one store serves every method), so for a LoGra store this method maps
the second moment into the projected space instead: the second moment of a projected coordinate when the
gradient's coordinates are independent with variances ``v``, i.e. the diagonal of ``P diag(v) P^T``, which for
LoGra's Kronecker projection ``P_rows G P_cols^T`` is ``(P_rows**2) V (P_cols**2)^T`` per matrix (``(P**2) v`` per
vector). On exact gradients the normalisation is TrackStar's exactly.

``precondition``: None (``R = I``), ``"autocorrelation"`` (TrackStar's own ``R``: the second-moment matrix of the
normalised training rows, ``N^T N + lambda I``, ``lambda = damping * mean eigenvalue``; with ``structure="joint"``
one ``D x D`` matrix, for projected stores; with ``structure="parameter"`` one block per captured parameter,
``N_p^T N_p + lambda_p I`` with each block's own mean eigenvalue, cross-parameter terms dropped -- Bergson's
per-module autocorrelation, which scales with the largest parameter instead of ``D``), a curvature method's name
(``"kfac"``, ``"ekfac"``, ``"ggn"``, ...: fitted in :meth:`fit` from the same model and data) or an already fitted
:class:`~gradtrace.fit.methods.Method` whose query transform is used as ``R^-1``. A method's curvature is the one of
the raw gradients (as fitted for that method); only ``"autocorrelation"`` is the curvature of the normalised ones.
Positive = helpful; scores are cosines in ``[-1, 1]``.

**Without Adam** (``second_moment="none"``): ``v_hat = 1`` and no ``eps`` (``n = g``), the normaliser an SGD run
implies (SGD's update applies the raw gradient); no optimizer is read. It is never chosen for you: at the default
``second_moment="adam"`` an optimizer state without Adam's second moment (SGD's ``momentum_buffer``, or none) is an
error naming this option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...common.checkpoints import saved_optimizer_parameter_names
from ...common.checks import at_least, count
from ...common.units import human_bytes
from ...projection.logra import LoGra
from ...store.spec import GradientSpec, SpecMismatch
from ..curvature.curvature import CurvatureError
from .base import Method, MissingStage, get_method, register_method
from .less import AdamState, NoAdamState, adam_states

__all__ = ["TrackStar", "bias_corrected", "load_optimizer_state", "optimizer_parameter_names",
           "recorded_parameter_names", "second_moment_denominator"]

RECORD_HINT = ("pass attr.fit(model, optimizer=...) with the torch.optim.Adam/AdamW optimizer at the attributed "
               "weights, its state_dict(), or a Trainer checkpoint directory holding optimizer.pt "
               "(gradtrace.integrations.checkpoints(store) lists those a GradtraceCallback run saved)")


def recorded_parameter_names(manifest: dict[str, Any]) -> list[str] | None:
    """The names of the optimizer's parameters in its order, as a store records them: a ``GradtraceCallback``
    store in ``config["trainer"]``, a :func:`gradtrace.collect_checkpoints` store of a Trainer run's checkpoint in
    ``config["checkpoint"]`` (None when neither does)."""
    config = manifest.get("config") or {}
    for key in ("trainer", "checkpoint"):
        names = (config.get(key) or {}).get("optimizer_parameters")
        if names:
            return list(names)
    return None


def optimizer_parameter_names(given: Any, store: Any, optimizer: Any) -> list[str] | None:
    """The names that map ``optimizer``'s state to the model's parameters: ``given``, else those ``store`` records
    (:func:`recorded_parameter_names`), else those a ``GradtraceCallback`` saved beside the checkpoint's
    ``optimizer.pt`` when ``optimizer`` is its path (:func:`~gradtrace.common.checkpoints.
    saved_optimizer_parameter_names`); None: match by position (one parameter group only)."""
    if given:
        return list(given)
    return (recorded_parameter_names(getattr(store, "manifest", None) or {})
            or saved_optimizer_parameter_names(optimizer))


def load_optimizer_state(optimizer: Any) -> Any:
    """An optimizer, its ``state_dict()``, or a path to an ``optimizer.pt`` (or a checkpoint directory holding one),
    as :func:`~gradtrace.fit.methods.less.adam_states` takes it. Files are loaded with ``weights_only=True``."""
    if isinstance(optimizer, (str, Path)):
        path = Path(optimizer)
        if path.is_dir():
            path = path / "optimizer.pt"
        if not path.is_file():
            raise FileNotFoundError(f"trackstar: no optimizer state at {path}; {RECORD_HINT}")
        return torch.load(path, map_location="cpu", weights_only=True)
    return optimizer


def bias_corrected(state: AdamState) -> Tensor:
    """Adam's ``v_hat`` (float32, the parameter's shape): ``max_exp_avg_sq`` under amsgrad, else ``exp_avg_sq``."""
    second = state.max_exp_avg_sq if state.max_exp_avg_sq is not None else state.exp_avg_sq
    correction = 1.0 - state.beta2 ** max(state.step, 1.0)
    return second.detach().to(torch.float32) / correction


def _projected_moment(projection: LoGra, name: str, moment: Tensor) -> Tensor:
    """``[k]``: the diagonal of ``P diag(v) P^T`` for ``name``'s LoGra projection (see the module docstring)."""
    projector = projection.projector
    if moment.dim() == 1:
        return projector.matrix(name, "vector", moment.shape[0]).square() @ moment
    matrix = moment.reshape(moment.shape[0], -1)
    rows = projector.matrix(name, "rows", matrix.shape[0]).square()
    cols = projector.matrix(name, "cols", matrix.shape[1]).square()
    return (rows @ matrix @ cols.t()).reshape(-1)


def second_moment_denominator(spec: GradientSpec, states: dict[str, AdamState], eps: float) -> Tensor:
    """``[D]``: ``sqrt(v_hat) + eps`` laid out like ``spec``'s rows (mapped into a LoGra projection's space)."""
    projection = None
    if spec.projection is not None:
        if spec.projection.get("kind") != "logra":
            raise SpecMismatch(f"trackstar: gradients projected with {spec.projection.get('kind')!r} cannot be "
                               "normalised by Adam's second moment; collect exact or LoGra-projected gradients")
        projection = LoGra.from_dict(spec.projection)
    parts = []
    for name, dim in spec.params:
        moment = bias_corrected(states[name])
        if projection is not None:
            moment = _projected_moment(projection, name, moment)
        moment = moment.reshape(-1)
        if moment.numel() != dim:
            raise SpecMismatch(f"trackstar: parameter {name!r} has {dim} gradient coordinates in the store but its "
                               f"Adam state maps to {moment.numel()}; collect without joined biases")
        parts.append(moment.clamp(min=0).sqrt() + eps)
    return torch.cat(parts)


PRECONDITION_DIR = "precondition"
"""Where a saved TrackStar fit keeps a curvature method's preconditioner (its curvature, or its own saved fit)."""


def _save_preconditioner(method: Method, directory: Path) -> dict[str, Any]:
    """Save a fitted preconditioning method in ``directory``: a curvature method's curvature (``Curvature.save``),
    another method's saved fit; returns what ``fit.json`` records of it (name, settings, manifest checksum)."""
    from .saved import save_fit, saves_fit

    curvature = getattr(method, "curvature", None)
    if "curvature" in method.needs and curvature is not None:
        curvature.save(directory, overwrite=True)  # part of the fit being saved (its overwrite was checked)
        manifest = directory / "curvature.json"
        settings = {"damping": method.damping, "damping_mode": method.damping_mode}
    elif saves_fit(method):
        save_fit(method, directory, overwrite=True)
        manifest, settings = directory / "fit.json", {}
    else:
        raise TypeError(f"trackstar: a {method.name!r} preconditioner cannot be saved (its state is neither a "
                        "curvature nor a saved fit); precondition with kfac, ekfac, ggn, logra, trak or "
                        "'autocorrelation' to save the fit")
    return {"method": method.name, **settings,
            "manifest_blake2b": json.loads(manifest.read_text())["manifest_blake2b"]}


def _load_preconditioner(saved: dict[str, Any], directory: Path, damping: float | None,
                         damping_mode: str | None) -> Method:
    """The preconditioner :func:`_save_preconditioner` wrote, refused when it is not the one ``fit.json`` names
    (a later save into the same directory that did not finish)."""
    from .saved import FitError, is_saved_fit, load_fit

    try:
        name, recorded = saved["method"], saved["manifest_blake2b"]
    except (KeyError, TypeError) as err:
        raise FitError(f"{directory.parent / 'fit.json'} records its preconditioner without {err}; fit again") \
            from None
    manifest = directory / ("fit.json" if is_saved_fit(directory) else "curvature.json")
    try:
        found = json.loads(manifest.read_text()).get("manifest_blake2b")
    except (OSError, ValueError) as err:
        raise FitError(f"{directory}: the preconditioner's manifest is missing or unreadable ({err}); fit again") \
            from None
    if found != recorded:
        raise FitError(f"{directory} holds another preconditioner than the fit in {directory.parent} was saved with "
                       "(an interrupted or later save); fit again")
    if manifest.name == "fit.json":
        return load_fit(directory, name, damping=damping, damping_mode=damping_mode)
    return get_method(name, curvature=directory,
                      damping=saved.get("damping") if damping is None else damping,
                      damping_mode=saved.get("damping_mode") if damping_mode is None else damping_mode)


SECOND_MOMENTS = ("adam", "none")
"""``second_moment=``: Adam's ``v_hat`` from the optimizer state, or 1 (no normalisation, as SGD's update)."""

STRUCTURES = ("joint", "parameter")
"""``structure=`` of the autocorrelation: one ``D x D`` matrix, or one block per captured parameter."""


def _unit(rows: Tensor, eps: float = 1e-12) -> Tensor:
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=eps)


@register_method
class TrackStar(Method):
    """TrackStar (see the module docstring).

    eps: Adam's epsilon, added to ``sqrt(v_hat)`` (None: the optimizer's own).
    precondition: None, ``"autocorrelation"``, a curvature method's name or a fitted method.
    damping: relative damping of ``"autocorrelation"`` (times the mean eigenvalue, of each block).
    precondition_options: options of the curvature method named by ``precondition``.
    max_dim: refuse ``"autocorrelation"`` for more dimensions (per block: ``D`` joint, a parameter's dimensions
        per parameter).
    structure: of ``"autocorrelation"``: ``"joint"`` (one ``D x D`` matrix) or ``"parameter"`` (one block per
        captured parameter).
    second_moment: ``"adam"`` (Adam's ``v_hat``, read in :meth:`fit`) or ``"none"`` (``n = g``: no Adam
        normalisation, the normaliser of an SGD run; fit needs no optimizer).
    """

    name = "trackstar"
    needs = ("second_moment",)
    per_member_options = ("optimizer",)  # the Adam state at one model's weights
    description = "TrackStar: Adam second-moment normalisation, optional curvature, unit-normalised (cosine)"

    def __init__(self, eps: float | None = None, precondition: str | Method | None = None, damping: float = 0.1,
                 precondition_options: dict[str, Any] | None = None, max_dim: int = 32768,
                 structure: str = "joint", second_moment: str = "adam") -> None:
        at_least(damping, "trackstar damping", 0)
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(f"trackstar: second_moment must be one of {', '.join(SECOND_MOMENTS)}, got "
                             f"{second_moment!r}")
        if second_moment == "none" and eps is not None:
            raise ValueError("trackstar: eps is added to Adam's sqrt(v_hat); second_moment='none' has no v_hat")
        count(max_dim, "trackstar max_dim")
        if eps is not None:  # Adam's: added to sqrt(v_hat), which may be 0 (torch.optim.Adam takes eps >= 0 too)
            at_least(eps, "trackstar eps", 0)
        if structure not in STRUCTURES:
            raise ValueError(f"trackstar: structure must be one of {', '.join(STRUCTURES)}, got {structure!r}")
        if structure != "joint" and precondition != "autocorrelation":
            raise ValueError(f"trackstar: structure={structure!r} is the autocorrelation's; it applies with "
                             "precondition='autocorrelation' only")
        self.eps, self.damping, self.max_dim, self.structure = eps, damping, max_dim, structure
        self.second_moment = second_moment
        self.precondition = precondition
        self.precondition_options = dict(precondition_options or {})
        self.curvature: Method | None = precondition if isinstance(precondition, Method) else None
        self.denominator: Tensor | None = None
        self.values: Tensor | None = None  # [D] float64: every block's eigenvalues, in the parameters' order
        self.vectors: list[Tensor] | None = None  # one float64 eigenbasis per block (one block when joint)
        self.spec: GradientSpec | None = None

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None, *,
            optimizer: Any = None, param_names: Any = None, **options: Any) -> None:
        """Read Adam's second moment of the stored parameters from ``optimizer`` (an Adam/AdamW optimizer, its
        ``state_dict()`` or a checkpoint directory / ``optimizer.pt``; ``param_names``: the names of its parameters
        in order, default the ones the store records, :func:`recorded_parameter_names`, else those a
        ``GradtraceCallback`` saved beside that ``optimizer.pt``), then fit the curvature of
        ``precondition`` (``options`` go to that method's fit). With ``second_moment="none"`` no optimizer is read
        (an ``optimizer=`` given is refused, so that an Adam state is never ignored)."""
        if self.second_moment == "none":
            if optimizer is not None:
                raise ValueError("trackstar: second_moment='none' reads no optimizer state; drop optimizer= or use "
                                 "second_moment='adam' (its default) to normalise by Adam's second moment")
            self.denominator = torch.ones(attributor.spec.dim, device=attributor.device)
        else:
            self._fit_second_moment(attributor, model, optimizer, param_names)
        self.spec = attributor.spec
        if self.precondition == "autocorrelation":
            self._fit_autocorrelation(attributor)
        elif isinstance(self.precondition, str):
            self.curvature = get_method(self.precondition, **self.precondition_options)
            self.curvature.fit(attributor, model, data, loss_fn, **options)
        elif self.precondition is not None and not isinstance(self.precondition, Method):
            raise ValueError(f"trackstar: precondition must be None, 'autocorrelation', a method name or a fitted "
                             f"method, got {self.precondition!r}")

    def _fit_second_moment(self, attributor: Any, model: Any, optimizer: Any, param_names: Any) -> None:
        """``denominator = sqrt(v_hat) + eps`` from the Adam state; any other state is refused, naming
        ``second_moment="none"``."""
        if optimizer is None:
            raise MissingStage(f"trackstar needs Adam's second moment (exp_avg_sq): {RECORD_HINT}")
        if model is None:
            raise MissingStage("trackstar: attr.fit(model, optimizer=...) needs the model, to match the optimizer's "
                               "parameters to the stored ones")
        spec = attributor.spec
        param_names = optimizer_parameter_names(param_names, attributor.train[0], optimizer)
        try:
            states = adam_states(model, load_optimizer_state(optimizer), [n for n, _ in spec.params],
                                 param_names=param_names)
        except NoAdamState as err:
            why = ("SGD's update applies the raw gradient, so the normaliser an SGD run implies is 1" if err.sgd else
                   "to score without Adam's normalisation")
            raise NoAdamState(f"trackstar: {err}; {why}: pass second_moment='none' (n = g, no optimizer needed)",
                              sgd=err.sgd) from None
        eps = self.eps if self.eps is not None else next(iter(states.values())).eps
        self.denominator = second_moment_denominator(spec, states, eps).to(attributor.device)

    def _bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each autocorrelation block in a row: the whole row, or each parameter's slice."""
        if self.structure == "joint":
            return [(0, self.spec.dim)]
        return list(self.spec.offsets().values())

    def _fit_autocorrelation(self, attributor: Any) -> None:
        bounds = self._bounds()
        widest = max(range(len(bounds)), key=lambda b: bounds[b][1] - bounds[b][0])
        size = bounds[widest][1] - bounds[widest][0]
        if size > self.max_dim:
            what = (f"{size:,}-dimensional gradients" if self.structure == "joint" else
                    f"parameter {self.spec.params[widest][0]} ({size:,} dimensions)")
            raise CurvatureError(f"trackstar: precondition='autocorrelation' of {what} takes "
                                 f"{human_bytes(8 * size * size)} (float64), beyond max_dim={self.max_dim:,}; collect "
                                 "projected gradients (options=CaptureOptions(projection=gradtrace.LoGra(rank=...)))"
                                 + (", use structure='parameter' (a block per parameter)"
                                    if self.structure == "joint" and len(self.spec.params) > 1 else "")
                                 + " or raise max_dim=")
        source = attributor.train[0]
        kernels = [torch.zeros(b - a, b - a, dtype=torch.float64, device=attributor.device) for a, b in bounds]
        for _, block in source.iter_blocks(attributor.block_rows, attributor.device):
            normalized = (block.to(torch.float32) / self.denominator).to(torch.float64)
            for (start, stop), kernel in zip(bounds, kernels):  # a loop over parameters, not examples
                part = normalized[:, start:stop]
                kernel += part.t() @ part
        values, self.vectors = [], []
        while kernels:  # each kernel freed once decomposed: the peak holds one eigendecomposition's workspace
            block_values, block_vectors = torch.linalg.eigh(kernels.pop(0))
            values.append(block_values.clamp(min=0))
            # row-major as a saved-then-loaded copy is: the same BLAS paths before and after a load, no copy at save
            self.vectors.append(block_vectors.contiguous())
        self.values = torch.cat(values)

    def check_ready(self) -> None:
        if self._unfitted_cosine():
            return
        if self.denominator is None and self.second_moment == "none":
            raise MissingStage("trackstar: fit its preconditioner first (attr.fit(...))")
        if self.denominator is None:
            raise MissingStage(f"trackstar needs Adam's second moment: {RECORD_HINT}")
        if self.curvature is not None:
            self.curvature.check_ready()

    def bind(self, spec: GradientSpec) -> None:
        self.check_ready()
        if self._unfitted_cosine():
            return
        if spec.params != self.spec.params or spec.projection != self.spec.projection:
            raise SpecMismatch("trackstar: the second moment was laid out for other gradients (parameters or "
                               "projection differ); fit it on these")
        if self.curvature is not None:
            self.curvature.bind(spec)

    def _inverse(self, normalized: Tensor, checkpoint: int) -> Tensor | None:
        """``R^-1 n`` (None when ``R = I``)."""
        if self.values is not None:
            rows = normalized.to(torch.float64)
            out = torch.empty_like(rows)
            for (start, stop), vectors in zip(self._bounds(), self.vectors):  # one block per parameter at most
                values = self.values[start:stop].to(normalized.device)
                lam = self.damping * float(values.mean())
                if float(values.min()) + lam <= 0:
                    raise CurvatureError("trackstar: the autocorrelation matrix is singular and damping is 0; use "
                                         "damping > 0")
                vectors = vectors.to(normalized.device)
                out[:, start:stop] = ((rows[:, start:stop] @ vectors) / (values + lam)) @ vectors.t()
            return out.to(torch.float32)
        if self.curvature is not None:
            return self.curvature.prepare_queries(normalized, checkpoint)
        return None

    def _unfitted_cosine(self) -> bool:
        """``second_moment="none"`` without a preconditioner, not fitted: nothing to fit, plain cosines of ``g``."""
        return self.denominator is None and self.second_moment == "none" and self.precondition is None

    def _normalized(self, rows: Tensor) -> Tensor:
        if self._unfitted_cosine():
            return rows.to(torch.float32)
        return rows.to(torch.float32) / self.denominator.to(rows.device)

    def _metric_norm(self, normalized: Tensor, inverse: Tensor) -> Tensor:
        """``[n, 1]``: ``sqrt(n^T R^-1 n)`` per row."""
        quadratic = (normalized * inverse).sum(1, keepdim=True)
        if bool((quadratic < 0).any()):
            raise CurvatureError("trackstar: the preconditioner is not positive definite on these gradients "
                                 "(n^T R^-1 n < 0); raise its damping")
        return quadratic.clamp(min=1e-30).sqrt()  # a zero gradient stays a zero row

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        """``R^-1 n_q / ||n_q||_R`` (``n_q / ||n_q||`` without preconditioning)."""
        self.check_ready()
        normalized = self._normalized(queries)
        inverse = self._inverse(normalized, checkpoint)
        if inverse is None:
            return _unit(normalized)
        return inverse / self._metric_norm(normalized, inverse)

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        """``n_i / ||n_i||_R`` (``n_i / ||n_i||`` without preconditioning)."""
        normalized = self._normalized(block)
        inverse = self._inverse(normalized, checkpoint)
        if inverse is None:
            return _unit(normalized)
        return normalized / self._metric_norm(normalized, inverse)

    def fit_state(self, path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The second moment's denominator, the autocorrelation's float64 eigendata, and a curvature method's
        preconditioner saved as its curvature in ``path/precondition`` (see :mod:`gradtrace.fit.methods.saved`)."""
        tensors = {"denominator": self.denominator}
        if self.values is not None:
            tensors["values"] = self.values
            tensors.update(zip(_vector_keys(self.structure, len(self.vectors)), self.vectors))
        fields = {"eps": self.eps, "damping": self.damping, "max_dim": self.max_dim, "structure": self.structure,
                  "second_moment": self.second_moment,
                  "spec": self.spec.to_dict(),
                  "precondition": self.precondition if isinstance(self.precondition, str) else None,
                  "preconditioner": None}
        if self.curvature is not None:
            fields["preconditioner"] = _save_preconditioner(self.curvature, path / PRECONDITION_DIR)
        return fields, tensors

    @classmethod
    def from_fit_state(cls, fields: dict[str, Any], tensors: dict[str, Tensor], spec: GradientSpec, path: Path,
                       damping: float | None = None, damping_mode: str | None = None) -> TrackStar:
        """A saved TrackStar fit. ``damping``: of the preconditioner (the autocorrelation's relative damping, or
        the curvature method's); ``damping_mode``: a curvature preconditioner's only."""
        from .saved import FitError, check_tensor, refuse_unused

        try:
            precondition, saved_curvature = fields["precondition"], fields["preconditioner"]
            eps, saved_damping, max_dim = fields["eps"], float(fields["damping"]), int(fields["max_dim"])
            structure = fields.get("structure", "joint")  # fits saved before structure= are joint
            second_moment = fields.get("second_moment", "adam")  # and before second_moment=, Adam's
        except (KeyError, TypeError, ValueError) as err:
            raise FitError(f"{path / 'fit.json'} is malformed ({err!r}); fit again") from None
        if precondition is None and saved_curvature is None and (damping is not None or damping_mode is not None):
            raise ValueError("trackstar: this fit has no preconditioner, so there is no damping to set; fit it with "
                             "precondition='autocorrelation' or a curvature method")
        if precondition == "autocorrelation" and damping_mode not in (None, "relative"):
            raise ValueError("trackstar: the autocorrelation's damping is relative (times its mean eigenvalue)")
        curvature = None
        if saved_curvature is not None:
            curvature = _load_preconditioner(saved_curvature, path / PRECONDITION_DIR, damping, damping_mode)
        own_damping = damping if precondition == "autocorrelation" and damping is not None else saved_damping
        if structure not in STRUCTURES or (structure != "joint" and precondition != "autocorrelation"):
            raise FitError(f"{path / 'fit.json'} records structure={structure!r}, which this fit cannot have; fit "
                           "again")
        method = cls(eps=eps, precondition=curvature if curvature is not None else precondition,
                     damping=own_damping, max_dim=max_dim, structure=structure, second_moment=second_moment)
        used = {"denominator"}
        method.denominator = check_tensor(tensors, "denominator", (spec.dim,), torch.float32, path)
        if precondition == "autocorrelation":
            method.spec = spec
            bounds = method._bounds()
            method.values = check_tensor(tensors, "values", (spec.dim,), torch.float64, path)
            keys = _vector_keys(structure, len(bounds))
            method.vectors = [check_tensor(tensors, key, (b - a, b - a), torch.float64, path)
                              for key, (a, b) in zip(keys, bounds)]
            used |= {"values", *keys}
        refuse_unused(tensors, used, path)
        if bool((method.denominator <= 0).any()):
            raise FitError(f"{path}: the second moment's denominator has non-positive entries (sqrt(v) + eps > 0 "
                           "always); fit again")
        method.spec = spec
        return method

    def options(self) -> dict[str, Any]:
        name = self.precondition if self.precondition is None or isinstance(self.precondition, str) else \
            self.precondition.name
        options = {"eps": self.eps, "precondition": name, "damping": self.damping,
                   "precondition_options": self.precondition_options}
        if self.structure != "joint":
            options["structure"] = self.structure
        if self.second_moment != "adam":
            options["second_moment"] = self.second_moment
        return options


def _vector_keys(structure: str, count: int) -> list[str]:
    """The saved fit's tensor names of the autocorrelation's eigenbases: ``vectors`` (joint, as fits saved before
    ``structure=``), ``vectors.0``, ``vectors.1``, ... (one per parameter, in the store's parameter order)."""
    return ["vectors"] if structure == "joint" else [f"vectors.{b}" for b in range(count)]
