"""Attribution methods: small classes registered by name, declaring the stages they need.

A method implements only its own math, on the two sides of the score ``tau(q, i) = <q', g_i'>``:

* :meth:`Method.prepare_queries` -- transform the (few) query gradients once, e.g. precondition them
  with an inverse curvature;
* :meth:`Method.prepare_train` -- a cheap per-block transform of streamed training gradients (e.g.
  normalising rows for cosine similarity).

and, where it needs them, the stages around scoring, each with a default that does nothing: :meth:`Method.fit`
(fit curvature or optimizer states), :meth:`Method.bind` (match them to the training gradients' layout) and
:meth:`Method.checkpoint_weights` (how checkpoints are summed; 1 each).

The scoring engine (:class:`gradtrace.Attributor`) streams the training gradients in blocks and does
the rest: one matrix product per block, checkpoint weighting, streaming top-k.

Sign convention everywhere: **a positive score means the training example helps the query** -- a
gradient step on it lowers the query's loss (to first order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

if TYPE_CHECKING:
    from pathlib import Path

    from ...store.spec import GradientSpec

__all__ = ["SIGN_CONVENTION", "Method", "MissingStage", "available_methods", "get_method", "method_class",
           "register_method"]

SIGN_CONVENTION = "positive = the training example helps the query (lowers its loss)"

_METHODS: dict[str, type[Method]] = {}


class MissingStage(RuntimeError):
    """A method was asked to score before a stage it needs was run (the message says which)."""


def register_method(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _METHODS[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    return sorted(_METHODS)


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


def get_method(name: str | Method, **options: Any) -> Method:
    """A method instance by registered name (or the instance itself)."""
    if isinstance(name, Method):
        return name
    return method_class(name)(**options)


class Method:
    """Base class of attribution methods.

    Class attributes:
        name: registry name (``"grad_dot"``).
        needs: stages required before scoring, e.g. ``("curvature",)``; each one's absence is
            reported by :meth:`check_ready` with the call that provides it.
        multi_checkpoint: the method combines gradients taken at several checkpoints.
        per_member_options: options of :meth:`fit` that hold state of one model's weights (trackstar's
            ``optimizer``), each also accepting a checkpoint directory: in an ensemble every member needs its
            own (:meth:`gradtrace.Ensemble.fit` refuses one shared by several members).
        description: one line for ``--help`` and reports.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()
    multi_checkpoint: ClassVar[bool] = False
    per_member_options: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"method {self.name!r} takes no options {sorted(options)}")

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None, **options: Any) -> None:
        """Run the stages the method needs (curvature, optimizer states, ...) for ``attributor``'s training
        gradients, from ``model`` and ``data`` where it needs a model pass; called by
        :meth:`gradtrace.Attributor.fit`. Default: nothing to fit (whatever is passed)."""

    @classmethod
    def has_fit(cls) -> bool:
        """Whether the method has a stage to fit (it overrides :meth:`fit`)."""
        return cls.fit is not Method.fit

    def bind(self, spec: GradientSpec) -> None:
        """Check the fitted stages against the training gradients' ``spec`` (their parameters and projection)
        and lay them out in its order; called before every scoring. Default: nothing to bind."""

    def checkpoint_weights(self, count: int) -> list[float]:
        """The weight of each of ``count`` checkpoints in the summed score. Default: 1 each."""
        return [1.0] * count

    def check_ready(self) -> None:
        """Raise :class:`MissingStage` if a stage this method needs has not been run."""

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        """``[Q, D] -> [Q, D]``: the query-side transform, applied once per checkpoint."""
        return queries

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        """``[n, D] -> [n, D]``: the per-block transform of training gradients."""
        return block

    def options(self) -> dict[str, Any]:
        """The method's settings, recorded with the scores."""
        return {}

    # -- a saved fit (gradtrace.fit.methods.saved), for methods whose fitted state is not a Curvature -------------
    def fit_state(self, path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The fitted state to save in directory ``path``: JSON-able fields (``"spec"``: the gradients' spec as a
        dict) and tensors. Methods that implement it can be saved with :func:`gradtrace.fit.methods.save_fit`."""
        raise TypeError(f"method {self.name!r} has no saved form")

    @classmethod
    def from_fit_state(cls, fields: dict[str, Any], tensors: dict[str, Tensor], spec: GradientSpec, path: Path,
                       **overrides: Any) -> Method:
        """The method rebuilt from what :meth:`fit_state` saved (checked: shapes from ``spec``, finite values);
        ``overrides``: settings changed without refitting (damping)."""
        raise TypeError(f"method {cls.name!r} has no saved form")
