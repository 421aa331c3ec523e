"""Every row's L2 norm, kept beside an index: the norm shortlist of :func:`gradtrace.score.shortlist.score_with_index`.

A score is an inner product ``<q, x_i> = |q| |x_i| cos``: rows of large norm reach the extreme scores in both
directions, and a query's most *negative* rows are mostly large-norm rows whose direction is noise relative to
it, spread over many IVF cells that a search with ``-q`` does not visit (cells gather rows by direction, not by
norm). Scoring the ``N`` rows of largest norm exactly for every query (``norm_rows=N``) puts them back in reach.

On disk: the tensor ``row_norms``, float32 ``[rows]`` (4 bytes per row; norms of the *raw* stored rows, also for
an index of normalized rows), in the index's checksummed tensor file (:meth:`gradtrace.score.Index.save`).
Indexes of version 1 kept them in ``INDEX/row_norms.npy`` with a size and checksum in ``index.json``;
:func:`read_row_norms` reads those and refuses a file that does not match the record.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..store.artifact import checksum
from ..store.layout import StoreError

__all__ = ["NORMS_FILE", "block_norms", "largest_norm_rows", "read_row_norms", "store_row_norms"]

NORMS_FILE = "row_norms.npy"


def block_norms(block: Tensor) -> Tensor:
    """``[n]`` float32 L2 norms of a ``[n, dim]`` block of rows (as read from the store: int8 rows scaled)."""
    return torch.linalg.vector_norm(block.to(torch.float32), dim=1)


def store_row_norms(store: Any, block_rows: int = 65536, progress: bool = False) -> Tensor:
    """``[rows]`` float32 L2 norms of every row of ``store``: one streaming pass, ``block_rows`` rows at a time."""
    norms = torch.empty(len(store), dtype=torch.float32)
    blocks = store.iter_blocks(block_rows, reuse=True)
    if progress:
        from ..common.progress import progress_bar

        blocks = progress_bar(blocks, total=math.ceil(len(store) / block_rows), desc="row norms", unit="block")
    for offset, block in blocks:
        norms[offset:offset + len(block)] = block_norms(block)
    return norms


def read_row_norms(directory: Path, record: dict[str, Any], rows: int, store_hint: str = "STORE") -> Tensor:
    """The norms a version-1 index saved in ``row_norms.npy``, checked against ``record`` (size, checksum) and ``rows``.

    A missing, truncated, edited or misshapen file is a :class:`StoreError` naming the command that rewrites it.
    """
    path = directory / str(record.get("file", NORMS_FILE))
    fix = f"rewrite them with gradtrace index {store_hint} --out {directory} --add-norms"
    if path.name != NORMS_FILE or not path.is_file():
        raise StoreError(f"index {directory}: its row norms ({NORMS_FILE}) are missing; {fix}")
    data = path.read_bytes()
    if len(data) != record.get("bytes") or checksum(data) != record.get("blake2b"):
        raise StoreError(f"index {directory}: {NORMS_FILE} is damaged ({len(data)} bytes, checksum "
                         f"{'matches' if checksum(data) == record.get('blake2b') else 'differs'}); {fix}")
    try:
        norms = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as err:
        raise StoreError(f"index {directory}: {NORMS_FILE} is not a norms file ({err}); {fix}") from None
    if norms.dtype != np.float32 or norms.shape != (rows,):
        raise StoreError(f"index {directory}: {NORMS_FILE} holds {norms.dtype} {norms.shape}, not float32 "
                         f"({rows},); {fix}")
    return torch.from_numpy(norms)


def largest_norm_rows(norms: Tensor, n: int) -> Tensor:
    """The ``min(n, rows)`` rows of largest norm, in increasing row order (int64 ``[n]``)."""
    n = min(n, len(norms))
    return torch.topk(norms, n, sorted=False).indices.sort().values
