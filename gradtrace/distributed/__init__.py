"""Distributed runs on ``torch.distributed``: capture under DDP / FSDP2, stores written by every rank, and
scoring sharded over ranks.

* Capture needs nothing new: ``gradtrace.capture`` works on a DDP-wrapped or ``fully_shard``-ed model (or on
  the inner model, before or after wrapping) and gives each rank the per-example gradients of its own
  examples; a ``StoreWriter`` on every rank writes one store.
* :func:`score_sharded` (from :mod:`gradtrace.score.sharded`) scores a store split across ranks and merges the
  top-k with collectives.
* :func:`check_same` / :func:`agreed` turn disagreeing ranks and one-rank failures into an error on every
  rank instead of a hang; :func:`process_group` joins the process group of a ``torchrun`` launch.

See ``docs/distributed.md``.
"""

from typing import Any

from ..common.ranks import rank_and_world
from .agree import RankFailure, RankMismatch, agreed, capture_spec, check_same, check_store_writers, gather_objects
from .env import comm_device, is_distributed, launched_by_torchrun, process_group

_SCORING = ("RowSubset", "rank_rows", "score_sharded")


def __getattr__(name: str) -> Any:
    """``score_sharded``, ``rank_rows`` and ``RowSubset`` (public here since they were written), resolved on first
    use from :mod:`gradtrace.score.sharded`: scoring sits above this package, which only makes ranks agree."""
    if name in _SCORING:
        from ..score import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "RankFailure", "RankMismatch", "RowSubset", "agreed", "capture_spec", "check_same", "check_store_writers",
    "comm_device", "gather_objects", "is_distributed", "launched_by_torchrun", "process_group", "rank_and_world",
    "rank_rows", "score_sharded",
]
