"""Numbers checked where they enter: a setting outside its range is refused on one line naming it and the range.

A bad number let in is rarely loud: ``damping=inf`` makes every score exactly 0 (a ranking of ties), a negative
learning rate flips the sign of a checkpoint's scores, and ``nan`` compares false with every bound, so ``x < 0``
lets it through. Every numeric setting therefore declares its :class:`Range`, checked before any work: by the
option objects (:mod:`gradtrace.options`, :func:`check_fields`), the methods' constructors, and the command line
(:mod:`gradtrace.cli.commands` checks every numeric option of every command from its ``min`` / ``max`` / ``valid``).

* A float must be finite (``Range(finite=False)`` for one that may not be);
* ``low`` / ``high`` bound it (``open_low``: strictly above ``low``);
* an integer must be an ``int`` (not a ``bool`` or a float).

A refusal is a ``ValueError`` ``"{name} must be {range}, got {value!r}"``; the command line prints it as its one
``Error:`` line (exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

__all__ = ["SEED", "Range", "at_least", "check_fields", "count", "finite", "fraction", "nonzero", "positive",
           "range_from", "rates", "seed"]


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts. ``kind``: ``int`` or ``float``; ``low`` / ``high``: bounds (None: none;
    ``open_low``: ``> low``); ``finite``: refuse NaN and +-inf (floats); ``nonzero``: refuse 0; ``label``: how the
    range reads in messages when the bounds would not say it better (seeds)."""

    kind: type = float
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    finite: bool = True
    nonzero: bool = False
    label: str | None = None

    def describe(self) -> str:
        """The range in words: ``"a finite number >= 0"``, ``"an integer >= 1"``, ``"a finite number in [0, 1]"``."""
        if self.label:
            return self.label
        what = "an integer" if self.kind is int else ("a finite number" if self.finite else "a number")
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.open_low else '['}{_num(self.low)}, {_num(self.high)}]"
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{what} <= {_num(self.high)}"
        return f"{what} other than 0" if self.nonzero else what

    def brief(self) -> str:
        """The range in ``--help``'s notation: ``x>=1``, ``x>0``, ``0<=x<=1``, ``finite``."""
        if self.label:
            return self.label.removeprefix("a ").removeprefix("an ")
        low = "" if self.low is None else f"{_num(self.low)}{'<' if self.open_low else '<='}"
        high = "" if self.high is None else f"<={_num(self.high)}"
        if low and high:
            return f"{low}x{high}"
        if low:
            return f"x{'>' if self.open_low else '>='}{_num(self.low)}"
        if high:
            return f"x{high}"
        return "finite, x!=0" if self.nonzero else "finite"

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is in the range."""
        if isinstance(value, bool) or not isinstance(value, Integral if self.kind is int else Real):
            return False
        if self.kind is not int and self.finite and not math.isfinite(value):
            return False
        if math.isnan(value):
            return not self.finite and self.low is None and self.high is None
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        if self.high is not None and value > self.high:
            return False
        return not (self.nonzero and value == 0)

    def check(self, value: Any, name: str) -> Any:
        """``value`` (an ``int`` / ``float``) if it is in the range, else a ValueError naming ``name`` and the
        range."""
        if not self.holds(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return int(value) if self.kind is int else float(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(value)


SEED = Range(int, -2**63, 2**64 - 1, label="a 64-bit integer (from -2**63 to 2**64 - 1)")
"""A seed: any integer a ``torch.Generator`` takes."""


def finite(value: Any, name: str) -> float:
    """``value`` as a float if it is finite."""
    return Range().check(value, name)


def at_least(value: Any, name: str, low: float) -> float:
    """``value`` as a float if it is finite and ``>= low``."""
    return Range(low=low).check(value, name)


def positive(value: Any, name: str) -> float:
    """``value`` as a float if it is finite and ``> 0``."""
    return Range(low=0, open_low=True).check(value, name)


def nonzero(value: Any, name: str) -> float:
    """``value`` as a float if it is finite and not 0 (a scale something is divided by)."""
    return Range(nonzero=True).check(value, name)


def fraction(value: Any, name: str) -> float:
    """``value`` as a float if it is in ``[0, 1]``."""
    return Range(low=0, high=1).check(value, name)


def count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` if it is an integer ``>= minimum`` (sizes, ranks, batch sizes, ``k``)."""
    return Range(int, minimum).check(value, name)


def seed(value: Any, name: str = "seed") -> int:
    """``value`` if it is a 64-bit integer (:data:`SEED`)."""
    return SEED.check(value, name)


def rates(values: Sequence[Any], name: str) -> list[float]:
    """Learning rates (or weights) each finite and ``>= 0``, not all 0: a negative one would flip the sign of its
    checkpoint's scores, all zeros make every score 0."""
    checked = [at_least(v, f"{name}[{i}]", 0) for i, v in enumerate(values)]
    if checked and not any(checked):
        raise ValueError(f"{name} are all 0, which makes every score 0: give at least one a positive value")
    return checked


def range_from(kind: type, metadata: Any) -> Range | None:
    """The :class:`Range` a field's metadata declares: ``valid`` (a :class:`Range`), or ``min`` / ``max``
    (``min_open``: strictly above ``min``) for a field of ``kind`` ``int`` / ``float``; a float field declaring
    nothing must still be finite. None: not a numeric field, or an integer one without bounds."""
    if "valid" in metadata:
        return metadata["valid"]
    if kind not in (int, float):
        return None
    low, high = metadata.get("min"), metadata.get("max")
    if kind is int and low is None and high is None:
        return None
    return Range(kind, low, high, open_low=bool(metadata.get("min_open", False)))


def check_fields(options: Any) -> None:
    """Check every field of dataclass ``options`` whose metadata declares a range (:func:`range_from`; the field's
    own annotation, as a string under ``from __future__ import annotations``, gives its kind). None passes."""
    for f in fields(options):
        kind = _kind(f.type)
        rule = range_from(kind, f.metadata) if kind is not None or "valid" in f.metadata else None
        value = getattr(options, f.name)
        if rule is not None and value is not None:
            rule.check(value, f.name)


def _kind(annotation: Any) -> type | None:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = {p.strip() for p in text.split("|")} - {"None"}
    if parts == {"int"}:
        return int
    if parts == {"float"}:
        return float
    return None
