"""Scoring a training store split across the ranks of a ``torch.distributed`` run.

``score_sharded(attributor, queries)`` is called on every rank. Each rank streams only its share of the
training rows through the ordinary engine (:class:`gradtrace.Attributor`), then the ranks merge:

* top-k: every rank pads its local top-k ``[Q, k]`` (values, *global* row indices) and all ranks
  ``all_gather`` them; the merged top-k of the ``W * k`` candidates is the global top-k;
* the full ``[Q, N]`` matrix only when asked (``matrix=True``, or ``"auto"`` when it fits the budget):
  one ``all_gather`` of the padded local columns.

Every collective runs on every rank, also on a rank with no rows, and every rank returns the same
:class:`Scores`, equal to single-process scoring (up to the order of exactly tied scores). The inputs are
checked first with one cheap collective (same store rows and ids, same queries and spec, same options),
and an error on one rank is raised on all of them (:mod:`gradtrace.distributed.agree`), so a bad input
is an error everywhere, never a hang.

Splits: ``"balanced"`` gives rank ``r`` the rows ``[r*N/W, (r+1)*N/W)``; ``"writer"`` gives it the rows
the store's writer rank(s) ``w`` with ``w % W == r`` committed (no rows move between nodes when each node
wrote its own shards; ranks may get uneven shares, or none).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..capture.gradient_set import GradientSet
from ..common.ranks import rank_and_world
from ..distributed.agree import agreed, check_same, gather_objects
from ..distributed.env import comm_device
from .engine import Attributor
from .scores import Scores, scoring_meta

__all__ = ["SPLITS", "RowSubset", "rank_rows", "score_sharded"]

SPLITS = ("balanced", "writer")

Ranges = list[tuple[int, int]]


def rank_rows(source: Any, world_size: int, split: str = "balanced") -> list[Ranges]:
    """The training rows each rank scores: per rank, a list of ``(start, stop)`` row ranges."""
    num_rows = len(source)
    if split == "balanced":
        return [[(num_rows * r // world_size, num_rows * (r + 1) // world_size)] for r in range(world_size)]
    if split != "writer":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    shards = getattr(source, "shards", None)
    if shards is None:
        raise ValueError("split='writer' scores the rows each rank wrote, which only a gradient store records; "
                         "use split='balanced' for in-memory gradients")
    out: list[Ranges] = [[] for _ in range(world_size)]
    for shard in shards:
        ranges = out[shard.rank % world_size]
        if shard.rows and ranges and ranges[-1][1] == shard.start:
            ranges[-1] = (ranges[-1][0], shard.start + shard.rows)
        elif shard.rows:
            ranges.append((shard.start, shard.start + shard.rows))
    return out


class RowSubset:
    """Some row ranges of a gradient source, read as one source (what one rank scores)."""

    def __init__(self, source: Any, ranges: Ranges) -> None:
        self.source = source
        self.ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
        self.spec = source.spec
        self.ids: list[str] = [i for lo, hi in self.ranges for i in source.ids[lo:hi]]
        self._offsets = [0]
        for lo, hi in self.ranges:
            self._offsets.append(self._offsets[-1] + hi - lo)

    def __len__(self) -> int:
        return self._offsets[-1]

    @property
    def dim(self) -> int:
        return self.spec.dim

    def global_index(self) -> Tensor:
        """``[len(self)]`` row of each local row in the whole source."""
        parts = [torch.arange(lo, hi) for lo, hi in self.ranges]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor:
        parts = []
        for (lo, _), first, last in zip(self.ranges, self._offsets, self._offsets[1:]):
            a, b = max(start, first), min(stop, last)
            if a < b:
                parts.append(self.source.read(lo + a - first, lo + b - first, device))
        if not parts:
            return torch.zeros(0, self.spec.dim, device=device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def iter_blocks(self, block_rows: int = 8192, device: torch.device | str | None = None
                    ) -> Iterator[tuple[int, Tensor]]:
        for start in range(0, len(self), block_rows):
            yield start, self.read(start, start + block_rows, device)


def _ids_digest(ids: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for ident in ids:
        h.update(str(ident).encode())
        h.update(b"\0")
    return h.hexdigest()


def _all_gather(tensor: Tensor, group: Any) -> list[Tensor]:
    """``tensor`` (same shape on every rank) of every rank, on the CPU."""
    device = comm_device(group)
    local = tensor.to(device).contiguous()
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.cpu() for t in out]


def _merge_topk(local: tuple[Tensor, Tensor] | None, global_index: Tensor, num_queries: int, k: int,
                largest: bool, group: Any, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Global top-k from every rank's local top-k (local row indices mapped to global ones), scores in ``dtype``."""
    fill = float("-inf") if largest else float("inf")
    values = torch.full((num_queries, k), fill, dtype=dtype)
    index = torch.full((num_queries, k), -1, dtype=torch.long)
    if local is not None:
        kept = local[0].shape[1]
        values[:, :kept] = local[0]
        index[:, :kept] = global_index[local[1]]
    values = torch.cat(_all_gather(values, group), dim=1)  # [Q, W * k], rank order = row order
    index = torch.cat(_all_gather(index, group), dim=1)
    values, order = torch.topk(values, k, dim=1, largest=largest)
    return values, torch.gather(index, 1, order)


def _gather_matrix(local: Tensor | None, ranges: list[Ranges], num_queries: int, num_rows: int,
                   group: Any, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``[Q, N]`` matrix in ``dtype`` from every rank's columns (padded to the longest share for
    ``all_gather``)."""
    counts = [sum(hi - lo for lo, hi in r) for r in ranges]
    width = max(counts)
    padded = torch.zeros(num_queries, width, dtype=dtype)
    if local is not None:
        padded[:, :local.shape[1]] = local
    full = torch.empty(num_queries, num_rows, dtype=dtype)
    for part, rank_ranges in zip(_all_gather(padded, group), ranges):
        column = 0
        for lo, hi in rank_ranges:
            full[:, lo:hi] = part[:, column:column + hi - lo]
            column += hi - lo
    return full


def score_sharded(attributor: Attributor, queries: Any, *, topk: int | None = 100, matrix: bool | str = "auto",
                  split: str = "balanced", sync_queries: bool = True, progress: bool = False,
                  group: Any = None) -> Scores:
    """Score queries against the training rows split across ranks; call it on every rank.

    Args:
        attributor: the :class:`Attributor` (method, training gradients -- the whole store, opened on every
            rank -- block size, device, matrix budget), fitted if its method needs it.
        queries: query gradients, as for :meth:`Attributor.score` (the same on every rank).
        topk, matrix, progress: as for :meth:`Attributor.score` (``"auto"`` decides from the global size);
            the progress bar is shown on rank 0.
        split: ``"balanced"`` (equal shares of rows) or ``"writer"`` (rows written by matching store ranks).
        sync_queries: score rank 0's query gradients on every rank (a broadcast), so that gradients computed
            on several devices that differ in their last bits cannot make ranks score different queries.
        group: the process group (default: the global one).

    Returns the same :class:`Scores` on every rank. Without a process group (or with one rank) this is
    ``attributor.score(...)``.
    """
    rank, world = rank_and_world(group)
    if world == 1:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return attributor.score(queries, topk=topk, matrix=matrix, progress=progress)
    method = attributor.method
    train = attributor.train
    multi = method.multi_checkpoint
    with agreed("preparing sharded scoring", group):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        method.check_ready()
        query_sets = attributor._query_sets(queries)
        num_q, num_rows = len(query_sets[0]), len(train[0])
        keep_matrix = attributor._keep_matrix(num_q, num_rows, topk, matrix)
        ranges = rank_rows(train[0], world, split)
        inputs = {
            "method": method.name, "options": repr(method.options()), "topk": topk, "matrix": keep_matrix,
            "score_dtype": attributor.score_dtype,
            "split": split, "sync_queries": sync_queries, "ranges": ranges,
            "train": [{"rows": len(t), "ids": _ids_digest(t.ids), "spec": t.spec.to_dict()} for t in train],
            "queries": [{"rows": len(q), "ids": _ids_digest(q.ids), "spec": q.spec.to_dict()} for q in query_sets],
        }
    check_same(inputs, "the inputs of sharded scoring (store rows and ids, queries, method, options)", group)

    if sync_queries:
        synced = []
        for q in query_sets:
            with agreed("reading the query gradients", group):
                vectors = q.read(0, len(q)).to("cpu", torch.float32).contiguous()
            device = comm_device(group)
            vectors = vectors.to(device)
            dist.broadcast(vectors, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            synced.append(GradientSet(vectors.cpu(), list(q.ids), q.spec))
        query_sets = synced

    views = [RowSubset(t, ranges[rank]) for t in train]
    local: Scores | None = None
    start = time.perf_counter()
    with agreed("scoring this rank's training rows", group):
        if len(views[0]):
            local_attributor = Attributor(method, train=views if multi else views[0],
                                          block_rows=attributor.block_rows, device=attributor.device,
                                          matrix_bytes=attributor.matrix_bytes, score_dtype=attributor.score_dtype)
            local = local_attributor.score(query_sets if multi else query_sets[0], topk=topk, matrix=keep_matrix,
                                           progress=progress and rank == 0)
    profile = dict(local.meta.get("profile", {})) if local is not None else {}
    profile.update(rows=len(views[0]), score_s=time.perf_counter() - start)
    profiles = gather_objects(profile, group)

    merge = time.perf_counter()
    global_index = views[0].global_index()
    top = bottom = full = None
    if topk:
        k = min(topk, num_rows)
        dtype = getattr(torch, attributor.score_dtype)
        top = _merge_topk(local.top if local else None, global_index, num_q, k, True, group, dtype)
        bottom = _merge_topk(local.bottom if local else None, global_index, num_q, k, False, group, dtype)
    if keep_matrix:
        full = _gather_matrix(local.matrix if local else None, ranges, num_q, num_rows, group,
                              getattr(torch, attributor.score_dtype))
    slowest = max(p["score_s"] for p in profiles)
    attributor.profile.update(score_s=slowest, merge_s=time.perf_counter() - merge,
                              rows_per_s=num_rows / max(slowest, 1e-9))
    spec = attributor.spec
    meta = scoring_meta(method, spec, weights=method.checkpoint_weights(len(train)), topk=topk, matrix=keep_matrix,
                        block_rows=attributor.block_rows, device=attributor.device, profile=attributor.profile,
                        score_dtype=attributor.score_dtype)
    meta["distributed"] = {"world_size": world, "split": split, "rows": [p["rows"] for p in profiles],
                           "profile": profiles}
    return Scores(train_ids=attributor.train_ids, query_ids=list(query_sets[0].ids), method=method.name,
                  matrix=full, top=top, bottom=bottom, meta=meta)
