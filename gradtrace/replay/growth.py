"""The growth of a metagradient reverse pass: the norm of the parameters' cotangent, once per segment.

The reverse pass of a run that is not metasmooth amplifies the cotangent step after step (Adam's ``1/sqrt(v)`` with
a tiny ``v`` at convergence), exponentially, until the dtype overflows. :class:`Growth` keeps the norm on the device
after each segment and reads it on the host together with the segment's finiteness check (one read per segment, no
sync per step); :func:`overflow_summary` turns the trace into the mean growth factor per step and how far float64
would reach at that rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["Growth", "cotangent_norm", "growth_rate", "overflow_summary"]

Key = tuple[str, ...]


def cotangent_norm(cotangent: dict[Key, Tensor]) -> Tensor:
    """The largest, over the queries of the pass, 2-norm of the parameters' cotangent (all parameters together), as
    a 0-d float64 tensor on the cotangents' device (NaN/inf when a cotangent is not finite). No host sync."""
    squares = [c.reshape(c.shape[0], -1).double().square().sum(dim=1) for key, c in cotangent.items()
               if key[0] == "param"]  # each [Q]
    if not squares:
        return torch.zeros((), dtype=torch.float64, device=next(iter(cotangent.values())).device)
    return torch.stack(squares).sum(dim=0).sqrt().max()


class Growth:
    """The trace of one reverse pass: ``(step, norm)`` pairs, ``norm`` the cotangent's norm of the state ``s_step``
    (``step = T``: the query gradients at the end of the run). Norms wait on the device until :meth:`read`."""

    def __init__(self) -> None:
        self.trace: list[tuple[int, float]] = []
        self._pending: list[tuple[int, Tensor]] = []

    def add(self, step: int, cotangent: dict[Key, Tensor]) -> None:
        """Note the cotangent's norm at ``step`` (a device op only)."""
        self._pending.append((step, cotangent_norm(cotangent)))

    def read(self, *flags: Tensor) -> list[bool]:
        """Move the pending norms to :attr:`trace` and read ``flags`` (0-d bool tensors) in the same host read."""
        values = torch.stack([norm for _, norm in self._pending] + [f.to(torch.float64) for f in flags]).tolist()
        count = len(self._pending)
        self.trace += [(step, value) for (step, _), value in zip(self._pending, values[:count])]
        self._pending = []
        return [bool(v) for v in values[count:]]


def merge(traces: Iterable[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """One trace of several reverse passes (query blocks): the largest norm at each step, from the end of the run."""
    merged: dict[int, float] = {}
    for trace in traces:
        for step, norm in trace:
            merged[step] = norm if step not in merged else max(merged[step], norm)
    return sorted(merged.items(), reverse=True)


def growth_rate(trace: list[tuple[int, float]]) -> tuple[int, float, int, float, float] | None:
    """``(first_step, first_norm, last_step, last_norm, rate)`` over the finite, positive part of the trace: the mean
    growth factor per step ``(last / first) ** (1 / steps)``; None with fewer than two such points."""
    finite = [(s, n) for s, n in trace if math.isfinite(n) and n > 0]
    if len(finite) < 2:
        return None
    (first_step, first), (last_step, last) = finite[0], finite[-1]
    if first_step == last_step:
        return None
    return first_step, first, last_step, last, (last / first) ** (1 / (first_step - last_step))


def overflow_summary(trace: list[tuple[int, float]], dtype: torch.dtype, start: int, stop: int,
                     begin: int = 0) -> str:
    """How the norm grew up to an overflow between steps ``start`` and ``stop - 1``, and whether float64 could reach
    the first step of the pass (``begin``: 0, the start of the run, unless the pass is truncated) at that rate:
    ``log(float64 max / norm) / log(rate)`` steps from the last finite norm."""
    finite = [(s, n) for s, n in trace if math.isfinite(n) and n > 0]
    if not finite:
        return "the cotangent was not finite at the end of the run already (the query gradients)"
    first_step, first = finite[0]
    fitted = growth_rate(trace)
    if fitted is not None:
        _, _, last_step, last, rate = fitted
        text = (f"the norm of the parameters' cotangent grew from {first:.3g} at step {first_step} (the end of the "
                f"run) to {last:.3g} at step {last_step}, over {first_step - last_step} steps: x{rate:.4g} per step "
                f"on average")
        bound = ""
    else:  # overflowed in the first segment: the dtype's max was reached within first_step - start steps at most
        last_step, last = first_step, first
        rate = (torch.finfo(dtype).max / first) ** (1 / max(first_step - start, 1))
        text = (f"the norm of the parameters' cotangent was {first:.3g} at step {first_step} (the end of the run) and "
                f"passed the {str(dtype).removeprefix('torch.')} max ({torch.finfo(dtype).max:.3g}) by step {start}: "
                f"at least x{rate:.4g} per step")
        bound = "at most "
    if rate <= 1:
        return text + "; the norm did not grow on average, so the overflow is a sudden one (float64 may not help)"
    reach = math.log(torch.finfo(torch.float64).max / last) / math.log(rate)
    goal = "the start of the run" if begin == 0 else f"step {begin}, where the pass stops"
    verdict = f"float64 could reach {goal}" if reach >= last_step - begin else (
        f"float64 would overflow too, before {goal}")
    return (text + f"; at that rate float64 (max {torch.finfo(torch.float64).max:.3g}) would hold {bound}~{reach:.0f} "
            f"more steps from step {last_step}, with {last_step - begin} steps left to {goal}: {verdict}")
