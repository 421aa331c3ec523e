"""What every option object shares: choice checks, and the JSON record artifacts keep of the resolved objects."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _choice(value: Any, name: str, allowed: Sequence[Any]) -> None:
    """Refuse ``value`` outside ``allowed`` with a one-line error naming the option."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def record(options: Any) -> dict[str, Any]:
    """The JSON form of a resolved option object (``dataclasses.asdict``; a LoGra spec as its ``to_dict()``,
    classes and callables by name), as artifacts record it."""
    return {f.name: _plain(getattr(options, f.name)) for f in fields(options)}


def _plain(value: Any) -> Any:
    logra = sys.modules.get("gradtrace.projection.logra")  # not imported yet: no value can be a LoGra spec
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
