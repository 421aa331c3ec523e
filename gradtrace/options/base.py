"""What every option object shares: choice checks, and the JSON record artifacts keep of the resolved objects."""

from __future__ import annotations

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
    """The JSON form of a resolved option object (``dataclasses.asdict``; a projection as its ``to_dict()``,
    classes and callables by name), as artifacts record it; a field whose metadata says ``"record": False`` (the
    user's own configuration, recorded beside it) is left out."""
    return {f.name: _plain(getattr(options, f.name)) for f in fields(options) if f.metadata.get("record", True)}


def _plain(value: Any) -> Any:
    logra = sys.modules.get("gradtrace.projection.logra")  # not imported yet: no value can be a LoGra spec
    if logra is not None and isinstance(value, logra.LoGra):
        return value.to_dict()
    sketch = sys.modules.get("gradtrace.projection.sketch")
    if sketch is not None and isinstance(value, sketch.Sketch):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return value


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


def option_object(value: Any, cls: type, name: str) -> Any:
    """``value`` when it is a ``cls`` (a default one for None), else a TypeError naming the parameter ``name``."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name}= must be a gradtrace.{cls.__name__}, got {type(value).__name__}")
    return value
