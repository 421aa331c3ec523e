"""This process's rank and the world size of a ``torch.distributed`` run (``(0, 1)`` outside one).

On the bottom floor so that every layer (a store writer naming its shards, a capture checking its ranks) can ask
without importing :mod:`gradtrace.distributed`, which sits at the top with the sharded scoring.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["rank_and_world"]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (the default group when None), or ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
