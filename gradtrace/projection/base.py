"""The one :class:`Projection` protocol of gradtrace, and the registry that rebuilds a projection from its spec.

A projection maps per-example gradients to ``k`` numbers each (``project``) and describes itself as a JSON-able
spec (``to_dict``) that stores and query sets record; ``from_dict`` rebuilds the projection from that spec. Each
kind registers the ``"kind"`` values of its specs with :func:`register_projection`, so the untyped spec dicts
found in a :class:`gradtrace.GradientSpec` (``spec.projection``) are resolved in one place,
:func:`projection_from_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

__all__ = ["Projection", "ProjectionError", "projection_from_dict", "projection_kinds", "register_projection"]


class ProjectionError(ValueError):
    """A projection spec that this gradtrace cannot rebuild, or a projection of the wrong kind."""


@runtime_checkable
class Projection(Protocol):
    """What every projection implements (:class:`gradtrace.LoGra`, the :class:`~gradtrace.projection.Sketch`
    family)."""

    def project(self, grads: Tensor, key: str = "") -> Tensor:
        """Per-example gradients ``[E, ...]`` of what ``key`` names (e.g. a parameter) -> ``[E, k]`` float32."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The spec as stored in manifests: a ``"kind"`` and every field that determines the projected numbers."""
        ...

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Projection:
        """Rebuild the projection that :meth:`to_dict` described."""
        ...


_KINDS: dict[str, type] = {}
P = TypeVar("P", bound=type)


def register_projection(*kinds: str) -> Callable[[P], P]:
    """Class decorator: specs whose ``"kind"`` is one of ``kinds`` are rebuilt by this class's ``from_dict``."""

    def register(cls: P) -> P:
        for kind in kinds:
            if _KINDS.get(kind, cls) is not cls:
                raise ValueError(f"projection kind {kind!r} is registered twice ({_KINDS[kind].__name__}, "
                                 f"{cls.__name__})")
            _KINDS[kind] = cls
        return cls

    return register


def projection_kinds() -> dict[str, type]:
    """``{spec kind: class}`` of every registered projection."""
    return dict(_KINDS)


def projection_from_dict(spec: dict[str, Any] | None, *, expect: type | None = None,
                         what: str = "the gradients") -> Any:
    """The projection a spec dict describes (None for ``None``: exact gradients), rebuilt by its registered kind.

    expect: the class the caller needs (e.g. :class:`gradtrace.LoGra` to capture more gradients the same way);
        another kind is refused. what: names whose spec this is, in errors (e.g. ``"store runs/train"``).
    Raises :class:`ProjectionError` for an unknown kind, another kind than ``expect``, an incomplete spec, or one
    the rebuilt projection does not reproduce exactly (e.g. a PCA-initialised LoGra, whose basis is not in the spec).
    """
    if spec is None:
        return None
    kind = spec.get("kind")
    cls = _KINDS.get(kind)
    if expect is not None and (cls is None or not issubclass(cls, expect)):
        raise ProjectionError(f"{what} were projected with a {kind!r} projection; this rebuilds {expect.__name__} "
                              "projections only (compute the other side in Python with the same projection)")
    if cls is None:
        raise ProjectionError(f"{what} were projected with a {kind!r} projection, which this gradtrace does not know "
                              f"(it knows {', '.join(sorted(_KINDS))})")
    try:
        projection = cls.from_dict(spec)
    except (KeyError, TypeError, ValueError) as err:
        raise ProjectionError(f"{what} record an incomplete or unsupported {kind!r} projection ({err})") from None
    if projection.to_dict() != spec:
        raise ProjectionError(f"{what} were projected with {spec}, which this gradtrace cannot reproduce "
                              f"({projection.to_dict()}); use the gradtrace version, or the PCA basis, that made them")
    return projection
