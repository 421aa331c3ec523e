"""Typed option objects of the Python API, one per concern, shared by every entry point.

* :class:`CaptureOptions` -- what is captured and how the loop's loss is read (``capture``, ``collect``,
  ``fit_curvature``, ``GradtraceCallback``, ``less_features``/``less_query_features``);
* :class:`StoreOptions` -- how a gradient store is written (``collect``, ``GradtraceCallback``, the LESS
  features, ``TrajectoryWriter``);
* :class:`FitOptions` -- which curvature is fitted and how (``fit_curvature``).

Each entry point takes them as ``options=`` / ``store_options=`` / ``fit_options=`` *and* keeps its keyword
arguments (:func:`takes_options`): a field given both ways is an error; a field the entry point fixes itself
(``collect`` sums per-example losses) must be left at its default. The resolved objects are recorded with
the artifacts (:func:`with_record`: ``config.gradtrace.options`` in a store's ``manifest.json``, in a
curvature's ``meta``), and the command line builds the same objects (``gradtrace.cli``). A field's ``help``
metadata (on the fields the command line exposes) is also their ``--help`` text.

Numeric fields are checked when an object is made (:func:`gradtrace.common.checks.check_fields`: a field's ``min`` /
``max`` / ``valid`` metadata; floats finite), so a bad number is refused before any work, on one line naming it.

This module sits on the floor of the package: it imports only the standard library, :mod:`gradtrace.common` and
(when a projection is given) :mod:`gradtrace.projection`; not torch, so that the command line can build its options
from these fields without it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from .common.checks import SEED, check_fields, nonzero

__all__ = ["RECORD_KEY", "CaptureOptions", "FitOptions", "StoreOptions", "record", "takes_options", "with_record"]

F = TypeVar("F", bound=Callable[..., Any])

REDUCTIONS = ("mean", "sum", "token_mean")
EXAMPLE_LOSSES = ("sum", "mean")
STORE_DTYPES = ("float32", "bfloat16", "int8")
CURVATURE_KINDS = ("kfac", "ekfac", "fisher")


class _LoGraModule:
    """:mod:`gradtrace.projection.logra`, imported on first attribute access: the annotation ``_logra.LoGra``
    resolves (``typing.get_type_hints``) while importing this module imports no torch (the command line builds its
    ``--help`` from these classes)."""

    def __getattr__(self, name: str) -> Any:
        from .projection import logra

        return getattr(logra, name)


_logra = _LoGraModule()


def _choice(value: Any, name: str, allowed: Sequence[Any]) -> None:
    """Refuse ``value`` outside ``allowed`` with a one-line error naming the option."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """What is captured, and how the training loop's loss is read (see :class:`gradtrace.Capture`).

    Attributes:
        layers: module name globs or classes to capture (default: every supported module).
        exclude: module name globs or classes to leave out.
        include_frozen: also capture parameters with ``requires_grad=False``.
        reduction: how the loop reduced per-example losses into the loss it backpropagates:
            ``"mean"`` over rows, ``"sum"``, or ``"token_mean"`` (Hugging Face: target-token sum over
            the batch divided by their count or ``num_items_in_batch``); None: the entry point's default
            (``"mean"`` for ``capture``, derived from the Trainer by ``GradtraceCallback``).
        example_loss: the loss each captured gradient belongs to: ``"sum"`` over the example's target
            tokens (default) or the per-token ``"mean"``.
        loss_scale: any other constant the loop multiplied its loss by (e.g. ``1/accumulation_steps``,
            an AMP ``GradScaler`` scale): finite and not 0, since gradients are divided by it; a callable is evaluated
            at every forward call (its value checked likewise); None: 1 (derived from the Trainer by
            ``GradtraceCallback``).
        projection: ``gradtrace.LoGra(...)`` (or its dict form) to project at capture time, or None for exact
            gradients.
        packing: split packed rows into documents using ``position_ids`` restarts.
        multi_forward: when the model runs several forward calls before one backward: ``"concat"``
            (each call's rows are different examples) or ``"sum"`` (row ``i`` of every call is the
            same example, e.g. two views of it).
        broadcast: ``"expand"`` a layer output computed once for the whole batch (GPT-2's position
            embeddings on a ``[1, T]`` tensor) to one row per example, so it gets per-example
            gradients (values are unchanged); ``"skip"`` to leave such layers out.
        causal_lm: whether labels are shifted by one (logits at ``t`` predict ``labels[t+1]``); by
            default inferred from the model class name (``*ForCausalLM``, ``*LMHeadModel``).
        ignore_index: label value that marks non-target tokens.
        nonfinite: ``"flag"`` examples with NaN/inf gradients in ``batch.nonfinite`` (with a warning)
            or ``"raise"``.
        isolate_padding: replace NaN/inf at positions that belong to no example (padding) by 0 in the
            captured layers' outputs and output-gradients, so that they cannot reach the real tokens (masked
            attention multiplies a padded position's values by 0, which leaves NaN) and flag a whole padded
            batch. Finite values are never changed. Off by default because it changes the loss a training
            loop sees when padding holds NaN; :func:`gradtrace.collect` turns it on.
        strict: raise instead of warning when trainable parameters cannot be captured.
        verify: check after each backward pass that the per-example gradients, with the loss scale
            put back, sum to the batch gradient autograd computed (debugging; costs a little).
    """

    layers: Sequence[Any] | None = None
    exclude: Sequence[Any] | None = None
    include_frozen: bool = False
    projection: _logra.LoGra | None = None
    reduction: str | None = None
    example_loss: str = "sum"
    loss_scale: float | Callable[[], float] | None = None
    packing: bool = True
    multi_forward: str = "concat"
    broadcast: str = "expand"
    causal_lm: bool | None = None
    ignore_index: int = -100
    nonfinite: str = "flag"
    isolate_padding: bool = False
    strict: bool = False
    verify: bool = False

    def __post_init__(self) -> None:
        if self.reduction is not None:
            _choice(self.reduction, "reduction", REDUCTIONS)
        _choice(self.example_loss, "example_loss", EXAMPLE_LOSSES)
        if self.multi_forward not in ("concat", "sum"):
            raise ValueError(f"multi_forward must be 'concat' or 'sum', got {self.multi_forward!r}")
        if self.broadcast not in ("expand", "skip"):
            raise ValueError(f"broadcast must be 'expand' or 'skip', got {self.broadcast!r}")
        if self.nonfinite not in ("flag", "raise"):
            raise ValueError(f"nonfinite must be 'flag' or 'raise', got {self.nonfinite!r}")
        if self.loss_scale is not None and not callable(self.loss_scale):  # a 0-dim tensor too: as its float
            scale = self.loss_scale
            nonzero(float(scale) if hasattr(scale, "__float__") and not isinstance(scale, bool) else scale,
                    "loss_scale")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an integer, got {self.ignore_index!r}")
        if self.projection is None:
            return
        if isinstance(self.projection, dict):  # a spec's dict form (a store's manifest records it so)
            object.__setattr__(self, "projection", _logra.LoGra.from_dict(self.projection))
        if not isinstance(self.projection, _logra.LoGra):
            raise TypeError(f"projection must be a gradtrace.LoGra spec or None, got "
                            f"{type(self.projection).__name__}")


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How a gradient store is written (see :class:`gradtrace.store.ShardWriter`)."""

    dtype: Literal["float32", "bfloat16", "int8"] = field(default="float32", metadata={
        "help": "Storage precision of the vectors (int8: one float32 scale per row)."})
    resume: bool = field(default=False, metadata={
        "help": "Add to an existing store, skipping the ids it already holds."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing store."})
    shard_bytes: int | None = field(default=None, metadata={
        "help": "Bytes per shard file (default 256 MiB): as many rows as fit. A hard kill loses at most one shard.",
        "min": 1})
    shard_rows: int | None = field(default=None, metadata={
        "help": "Rows per shard file, instead of shard_bytes.", "min": 1})

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {self.dtype!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other; pass one of them")
        check_fields(self)


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


def record(options: Any) -> dict[str, Any]:
    """The JSON form of a resolved option object (``dataclasses.asdict``; a LoGra spec as its ``to_dict()``,
    classes and callables by name), as artifacts record it."""
    return {f.name: _plain(getattr(options, f.name)) for f in fields(options)}


def _plain(value: Any) -> Any:
    logra = sys.modules.get(f"{__package__}.projection.logra")  # not imported yet: no value can be a LoGra spec
    if logra is not None and isinstance(value, logra.LoGra):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return value


def takes_options(*, own: Sequence[str] = (), **groups: type) -> Callable[[F], F]:
    """Decorate an entry point taking option objects (``options=CaptureOptions``, ...) beside keyword arguments.

    For each group parameter: given an object, its fields replace the keyword arguments of the same names (one
    given as a keyword too is an error; a field the entry point has no keyword for must be at its default);
    without one, the keyword arguments are collected into one. Either way the entry point receives both the
    keyword values and the resolved object in the group parameter. ``own`` names keyword arguments that share a
    field's name but mean something else (LESS's ``projection`` is its sketch, not a LoGra spec): the entry point
    fixes those fields, as it fixes the fields it has no keyword for.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        what = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            for param, cls in groups.items():
                taken = [f for f in fields(cls) if f.name in signature.parameters and f.name not in own]
                options = _resolve(cls, bound.arguments.get(param), bound.arguments, signature, taken, what, param)
                bound.arguments[param] = options
                for f in taken:
                    bound.arguments[f.name] = getattr(options, f.name)
            return fn(*bound.args, **bound.kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _resolve(cls: type, given: Any, arguments: dict[str, Any], signature: inspect.Signature,
             taken: list[dataclasses.Field], what: str, param: str) -> Any:
    """The option object of group ``param``: ``given`` (checked against the explicit keyword ``arguments``) or one
    built from the keyword arguments and the signature's defaults of the fields the entry point ``taken``."""
    if given is None:
        values = {f.name: arguments.get(f.name, signature.parameters[f.name].default) for f in taken}
        return cls(**values)
    if not isinstance(given, cls):
        raise TypeError(f"{what}(): {param}= must be a gradtrace.options.{cls.__name__}, got {type(given).__name__}")
    both = sorted(f.name for f in taken if f.name in arguments)
    if both:
        raise ValueError(f"{what}(): {', '.join(both)} given both as a keyword argument and in {param}=; pass each "
                         "setting once")
    fixed = sorted(f.name for f in fields(cls) if f not in taken and getattr(given, f.name) != _default(f))
    if fixed:
        raise ValueError(f"{what}() sets {', '.join(fixed)} itself: leave {param}.{fixed[0]} at its default")
    return given


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


RECORD_KEY = "gradtrace"
"""The block of an artifact's configuration that gradtrace itself writes (the command line's provenance too)."""


def with_record(config: dict[str, Any] | None, **objects: Any) -> dict[str, Any]:
    """``config`` (not modified) with the resolved option ``objects`` recorded as
    ``config["gradtrace"]["options"][name]`` (:func:`record`; a None object is left out); the user's keys are left
    as they are."""
    out = dict(config or {})
    block = dict(out.get(RECORD_KEY) or {})
    block["options"] = {name: record(obj) for name, obj in objects.items() if obj is not None}
    out[RECORD_KEY] = block
    return out
