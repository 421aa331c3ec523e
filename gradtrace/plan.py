"""``gradtrace.plan``: what a collection will take, before it runs.

Counts the examples and tokens of ``data``, runs a short timed warm-up (the first batches, in memory) to
learn the captured parameters and the dimension of each example's vector, and compares the store's
expected size with the free space where it will be written. ``gradtrace collect`` prints this plan before
any gradient is stored, refuses a store that cannot fit (unless ``--force``), and ``--dry-run`` prints only it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .projection.logra import LoGra
from .store.shards import row_bytes

__all__ = ["Plan", "plan", "RECORD_BYTES_PER_ROW"]

RECORD_BYTES_PER_ROW = 96
"""Rough bytes a row adds to its shard's JSON record (id, step, content digest): part of the size estimate."""


@dataclass(frozen=True)
class Plan:
    """What collecting ``data`` into a store takes (sizes in bytes, times in seconds)."""

    examples: int
    tokens: int | None  # tokens in the inputs (attention-mask ones when given); None for non-token inputs
    params: int  # captured parameters
    dim: int  # values per example's vector
    dtype: str  # storage dtype
    bytes_per_example: int  # on disk: the vector (and its int8 scale)
    store_bytes: int  # expected store size: vectors plus records
    free_bytes: int | None  # free space where the store goes (None: no store path given)
    seconds_per_example: float  # from the warm-up (its first batch included: an upper estimate)

    @property
    def fits(self) -> bool:
        """The expected store fits in the free space (True when no store path was given)."""
        return self.free_bytes is None or self.store_bytes <= self.free_bytes

    @property
    def seconds(self) -> float:
        """Estimated time to collect every example."""
        return self.examples * self.seconds_per_example


def plan(model: nn.Module, data: Iterable[Any], loss_fn: Any = None, *, projection: LoGra | None = None,
         layers: Sequence[Any] | None = None, exclude: Sequence[Any] | None = None, dtype: str = "float32",
         store: str | Path | None = None, warmup_batches: int = 2, device: Any = None,
         id_key: str = "id") -> Plan:
    """The plan of ``collect(model, data, loss_fn, projection=..., store=..., dtype=...)``; see :class:`Plan`.

    ``data`` is iterated twice (counted, then its first ``warmup_batches`` batches are captured in memory):
    pass a list or a dataset, not a one-shot generator. Arguments as for :func:`gradtrace.collect`.
    """
    from .capture import capture
    from .collect import _batch_size, run_capture

    if warmup_batches < 1:
        raise ValueError("warmup_batches must be at least 1")
    if iter(data) is data:
        raise ValueError("plan() iterates data twice: pass a list or a dataset, not an iterator or generator")
    examples, tokens = 0, 0
    for batch in data:
        examples += _batch_size(batch)
        tokens = None if tokens is None else _add_tokens(tokens, batch)
    if examples == 0:
        raise ValueError("plan(): the data produced no examples")
    # the warm-up captures in memory as collect() does; NaN/inf gradients are collect()'s to report, not the plan's
    cap = capture(model, layers=layers, exclude=exclude, reduction="sum", example_loss="sum", projection=projection,
                  keep_batches=True, isolate_padding=True)
    start = time.perf_counter()
    seen = run_capture(model, islice(iter(data), warmup_batches), loss_fn, cap, id_key=id_key, device=device)
    seconds = (time.perf_counter() - start) / max(1, seen)
    if not cap.batches:
        raise ValueError("plan(): the warm-up batches produced no examples")
    dims = cap.batches[0].dims  # {parameter: values per example}
    dim = sum(dims.values())
    one = row_bytes(dim, dtype)
    return Plan(examples=examples, tokens=tokens, params=len(dims), dim=dim, dtype=dtype,
                bytes_per_example=one, store_bytes=examples * (one + RECORD_BYTES_PER_ROW),
                free_bytes=None if store is None else free_space(Path(store)), seconds_per_example=seconds)


def _add_tokens(total: int, batch: Any) -> int | None:
    """``total`` plus the batch's input tokens (attention-mask ones when given), None for non-token batches."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        return None
    mask = batch.get("attention_mask")
    return total + int(mask.sum()) if isinstance(mask, Tensor) else total + batch["input_ids"].numel()


def free_space(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
