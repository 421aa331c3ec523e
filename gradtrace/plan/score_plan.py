"""The plan of scoring: blocks, memory held, output size, the time of a first block."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..common.units import block_rows_for
from .resources import available_memory

__all__ = ["ScorePlan", "TOPK_ENTRY_BYTES", "plan_score"]


TOPK_ENTRY_BYTES = 12
"""Bytes of one kept top-k (or bottom-k) entry: a float32 score and an int64 row index."""


@dataclass(frozen=True)
class ScorePlan:
    """What scoring ``queries`` queries against a store takes (sizes in bytes, times in seconds).

    Memory is what the engine (:meth:`gradtrace.Attributor.score`) holds at its peak, whatever the store's
    size apart from the matrix: the float32 decode buffer of one block of training rows and the block's
    ``[Q, block]`` scores, the prepared queries (one float32 ``[Q, D]`` per checkpoint), the top-k and bottom-k
    state (kept and merged candidates: ``2 x Q x 2k`` entries), and the ``[Q, N]`` float32 matrix when kept.
    """

    rows: int  # training rows N
    dim: int  # values per row D
    dtype: str  # the store's storage dtype
    queries: int  # Q
    checkpoints: int  # stores scored together (TracIn checkpoints, ensemble members)
    block_rows: int
    blocks: int  # blocks streamed per store
    topk: int  # k kept per query and side (at most N)
    matrix: bool  # the full [Q, N] matrix is kept
    block_bytes: int  # decode buffer [block, D] + block scores [Q, block], float32
    query_bytes: int  # prepared queries, checkpoints x [Q, D] float32
    topk_bytes: int  # top-k and bottom-k state
    matrix_bytes: int  # [Q, N] float32 when kept, else 0
    output_bytes: int  # saved tensors (matrix, top/bottom values and indices) and the ids in scores.json
    available_bytes: int | None  # memory available where the products run (None: unknown)
    seconds_per_block: float  # reading, decoding and multiplying one block, every checkpoint (the first, timed)

    @property
    def memory_bytes(self) -> int:
        """Peak memory of the scoring loop."""
        return self.block_bytes + self.query_bytes + self.topk_bytes + self.matrix_bytes

    @property
    def fits(self) -> bool:
        """The scoring loop fits in the available memory (True when unknown)."""
        return self.available_bytes is None or self.memory_bytes <= self.available_bytes

    @property
    def seconds(self) -> float:
        """Estimated time of streaming every block (query gradients and preconditioning not included)."""
        return self.blocks * self.seconds_per_block


def plan_score(stores: Any, queries: int, *, topk: int | None = 100, matrix: bool | str = "auto",
               block_rows: int | None = None, matrix_limit: int = 2**30, device: Any = None) -> ScorePlan:
    """The plan of scoring ``queries`` queries against ``stores`` (one :class:`gradtrace.GradientStore` or path,
    or a list: checkpoints or ensemble members, scored block by block together).

    ``topk``, ``matrix``: as for :meth:`gradtrace.Attributor.score`; ``block_rows`` as for
    :class:`gradtrace.Attributor` (default: the rows of a 128 MiB float32 block) (``matrix="auto"`` keeps the
    matrix when it takes at most ``matrix_limit`` bytes, as ``Attributor(matrix_bytes=...)``). The time is that
    of the first block, read and multiplied by ``queries`` random query vectors with its top-k merged, for every
    store: needs no model and no query gradient.
    """
    from ..store import GradientStore

    sources = [s if isinstance(s, GradientStore) else GradientStore.open(s)
               for s in (stores if isinstance(stores, (list, tuple)) else [stores])]
    if queries < 1:
        raise ValueError("plan_score(): no queries")
    first = sources[0]
    rows, dim = len(first), first.dim
    block_rows = block_rows_for(dim) if block_rows is None else block_rows
    if block_rows < 1:
        raise ValueError("block_rows must be at least 1")
    if rows == 0:
        raise ValueError(f"plan_score(): store {first.root} is empty")
    k = min(topk or 0, rows)
    keep = (queries * rows * 4 <= matrix_limit) if matrix == "auto" else bool(matrix)
    block = min(block_rows, rows)
    matrix_bytes = queries * rows * 4 if keep else 0
    ids = sum(len(json.dumps(i)) + 2 for i in first.ids)
    output = matrix_bytes + 2 * queries * k * TOPK_ENTRY_BYTES + ids
    return ScorePlan(rows=rows, dim=dim, dtype=first.spec.dtype, queries=queries, checkpoints=len(sources),
                     block_rows=block, blocks=math.ceil(rows / block), topk=k, matrix=keep,
                     block_bytes=4 * block * (dim + queries), query_bytes=4 * len(sources) * queries * dim,
                     topk_bytes=2 * queries * 2 * k * TOPK_ENTRY_BYTES, matrix_bytes=matrix_bytes,
                     output_bytes=output, available_bytes=available_memory(device),
                     seconds_per_block=_time_first_block(sources, queries, block, k, device))


def _time_first_block(sources: list[Any], queries: int, block: int, k: int, device: Any) -> float:
    """Seconds to read the first ``block`` rows of every store, multiply them by ``queries`` random vectors and
    take the block's top-k and bottom-k."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    prepared = torch.randn(queries, sources[0].dim, generator=torch.Generator().manual_seed(0)).to(device)
    buffer = torch.empty(block, sources[0].dim, dtype=torch.float32)
    start = time.perf_counter()
    for source in sources:
        scores = prepared @ source.read(0, block, out=buffer).to(device).t()
        if k:  # the engine takes a block's top min(k, block) before merging
            torch.topk(scores, min(k, block), dim=1)
            torch.topk(scores, min(k, block), dim=1, largest=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
