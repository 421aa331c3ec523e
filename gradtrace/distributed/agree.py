"""Ranks that must agree, checked with one cheap collective, and errors that every rank sees.

A distributed run hangs when one rank fails or takes another code path while the others wait in a
collective. Two tools prevent that, and both run a collective on every rank (never ``if rank == 0``):

* :func:`check_same` gathers a small description from every rank (a capture's layers and projection, a
  store's path and dtype, the inputs of a sharded scoring) and raises :class:`RankMismatch` on *every*
  rank when one differs, naming the rank and the field;
* :func:`agreed` runs a local, collective-free step on every rank and then exchanges its outcome: when it
  failed anywhere, every rank raises (:class:`RankFailure` on the ranks where it succeeded, the original
  error where it failed), instead of the healthy ranks waiting forever in the next collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ..common.ranks import rank_and_world
from ..store.layout import StoreError, lock_is_stale, read_lock
from ..store.spec import SpecMismatch

__all__ = ["RankFailure", "RankMismatch", "agreed", "capture_spec", "check_same", "check_store_writers",
           "gather_objects"]


class RankMismatch(SpecMismatch):
    """Ranks of one run disagree on something that must be identical on all of them (raised on every rank)."""


class RankFailure(RuntimeError):
    """A step failed on other ranks (raised on the ranks where it succeeded; the message says where and why)."""


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` without a process group). A collective."""
    world = rank_and_world(group)[1]
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``b`` differs from ``a`` (nested dicts are compared key by key), or None when equal."""
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in b:
                return f"{where} is missing (rank 0 has {_short(a[key])})"
            if key not in a:
                return f"{where} is {_short(b[key])}, absent on rank 0"
            found = _difference(a[key], b[key], where)
            if found:
                return found
    return f"{path or 'value'} is {_short(b)} where rank 0 has {_short(a)}"


def check_same(value: Any, what: str, group: Any = None) -> None:
    """Raise :class:`RankMismatch` on every rank unless ``value`` (picklable) is equal on all ranks."""
    gathered = gather_objects(value, group)
    problems = [f"rank {r}: {_difference(gathered[0], other)}" for r, other in enumerate(gathered)
                if other != gathered[0]]
    if problems:
        raise RankMismatch(f"gradtrace: the {len(gathered)} ranks disagree on {what}: " + "; ".join(problems[:4])
                           + (f" (and {len(problems) - 4} more ranks)" if len(problems) > 4 else ""))


@contextlib.contextmanager
def agreed(what: str, group: Any = None) -> Iterator[None]:
    """Run a local step (no collectives inside) on every rank; if it fails anywhere, raise on every rank.

    ``with agreed("reading the queries"): ...``. The rank where it failed re-raises its own error; the
    others raise :class:`RankFailure` naming the failed ranks and their errors.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as err:
        error = err
    outcomes = gather_objects(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    failed: dict[str, list[int]] = {}
    for r, message in enumerate(outcomes):
        if message is not None:
            failed.setdefault(message, []).append(r)
    if failed:
        detail = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
                           for message, ranks in failed.items())
        raise RankFailure(f"gradtrace: {what} failed on {sum(map(len, failed.values()))} of {len(outcomes)} "
                          f"ranks ({detail})")


def capture_spec(capture: Any) -> dict[str, Any]:
    """What must be identical across the ranks of a capture: parameters and shapes, projection, loss."""
    return {
        "parameters": {name: list(handler.shapes[role]) for handler in capture.handlers
                       for role, name in handler.params.items()},
        "projection": capture.projection.to_dict() if capture.projection is not None else None,
        "loss": capture.convention.to_dict(),
    }


def _foreign_lock(root: Any, rank: int) -> dict[str, Any] | None:
    """The holder of ``rank``'s write lock when it is another live process (None when free, ours or stale)."""
    if not root.is_dir():
        return None
    holder = read_lock(root, rank)
    if not holder or lock_is_stale(holder):
        return None
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return None
    return holder


def check_store_writers(writer: Any, capture: Any, group: Any = None) -> None:
    """At the start of a capture whose ranks write one store together: every rank captures the same
    parameters with the same projection into the same store, and no other run holds any rank's lock.

    One ``all_gather_object``; raises :class:`RankMismatch` or :class:`StoreError` on every rank.
    """
    rank = writer.options["rank"] if writer.options["rank"] is not None else rank_and_world(group)[0]
    spec = {"capture": capture_spec(capture),
            "store": {"path": str(writer.path), "dtype": writer.dtype, "resume": writer.store_options.resume,
                      "overwrite": writer.store_options.overwrite}}
    gathered = gather_objects({"spec": spec, "locked": _foreign_lock(writer.path, rank), "rank": rank}, group)
    problems = [f"rank {r}: {_difference(gathered[0]['spec'], g['spec'])}" for r, g in enumerate(gathered)
                if g["spec"] != gathered[0]["spec"]]
    if problems:
        raise RankMismatch(f"gradtrace: the {len(gathered)} ranks writing {writer.path} disagree on what they "
                           "capture and store: " + "; ".join(problems[:4]))
    locked = [(g["rank"], g["locked"]) for g in gathered if g["locked"]]
    if locked:
        detail = ", ".join(f"rank {r} by pid {h.get('pid')} on {h.get('host')}" for r, h in locked)
        raise StoreError(f"{writer.path} is being written by another run ({detail}); two runs cannot write the "
                         "same store. Wait for that run or write to another directory.")
