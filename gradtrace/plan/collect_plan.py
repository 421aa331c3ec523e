"""The plan of ``collect``: examples, tokens, the row width and store size, the step memory, the time."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..capture.memory import StepMemory, estimate_step_memory
from ..options import CaptureOptions, Loss, RunOptions, StoreOptions
from ..options.base import option_object
from ..store.shards import row_bytes
from .resources import free_space

__all__ = ["Plan", "RECORD_BYTES_PER_ROW", "count_examples", "plan"]


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
    memory: StepMemory | None = None  # peak of one capture step at the largest batch (None: no transformer config)

    @property
    def fits(self) -> bool:
        """The expected store fits in the free space (True when no store path was given)."""
        return self.free_bytes is None or self.store_bytes <= self.free_bytes

    @property
    def seconds(self) -> float:
        """Estimated time to collect every example."""
        return self.examples * self.seconds_per_example


def plan(model: nn.Module, data: Iterable[Any], loss: Any = None, *, store: str | Path | None = None,
         options: CaptureOptions | None = None, store_options: StoreOptions | None = None,
         run: RunOptions | None = None, warmup_batches: int = 2) -> Plan:
    """The plan of ``collect(model, data, loss, store=..., options=..., store_options=..., run=...)``; see
    :class:`Plan`.

    ``data`` is iterated twice (counted, then its first ``warmup_batches`` batches are captured in memory):
    pass a list or a dataset, not a one-shot generator. Arguments as for :func:`gradtrace.collect`.
    """
    from ..capture import capture
    from ..capture.driver import run_capture

    options = option_object(options, CaptureOptions, "options")
    dtype = option_object(store_options, StoreOptions, "store_options").store_dtype
    loss = Loss.of(loss).summed("plan()")

    if warmup_batches < 1:
        raise ValueError("warmup_batches must be at least 1")
    if iter(data) is data:
        raise ValueError("plan() iterates data twice: pass a list or a dataset, not an iterator or generator")
    examples, tokens, largest = _count(data, "plan()")
    # the warm-up captures in memory as collect() does; NaN/inf gradients are collect()'s to report, not the plan's
    cap = capture(model, replace(loss, fn=None, reduction="sum"), options=replace(options, isolate_padding=True),
                  keep_batches=True)
    start = time.perf_counter()
    run = option_object(run, RunOptions, "run")
    seen = run_capture(model, islice(iter(data), warmup_batches), loss.fn, cap, replace(run, progress=False))
    seconds = (time.perf_counter() - start) / max(1, seen)
    if not cap.batches:
        raise ValueError("plan(): the warm-up batches produced no examples")
    dims = cap.batches[0].dims  # {parameter: values per example}
    dim = sum(dims.values())
    one = row_bytes(dim, dtype)
    return Plan(examples=examples, tokens=tokens, params=len(dims), dim=dim, dtype=dtype,
                bytes_per_example=one, store_bytes=examples * (one + RECORD_BYTES_PER_ROW),
                free_bytes=None if store is None else free_space(Path(store)), seconds_per_example=seconds,
                memory=None if largest is None else estimate_step_memory(model, *largest, dim))


def count_examples(data: Iterable[Any], what: str) -> tuple[int, int | None]:
    """The examples and input tokens (None for non-token inputs) of ``data``, iterated once."""
    return _count(data, what)[:2]


def _count(data: Iterable[Any], what: str) -> tuple[int, int | None, tuple[int, int] | None]:
    """:func:`count_examples`, and the ``(batch, length)`` of the batch of most tokens (None: not token inputs)."""
    from ..capture.driver import batch_size

    examples, tokens, largest = 0, 0, (0, 0)
    for batch in data:
        examples += batch_size(batch)
        tokens = None if tokens is None else _add_tokens(tokens, batch)
        shape = tuple(batch["input_ids"].shape) if tokens is not None else ()
        if len(shape) == 2 and shape[0] * shape[1] > largest[0] * largest[1]:
            largest = shape  # type: ignore[assignment]
    if examples == 0:
        raise ValueError(f"{what}: the data produced no examples")
    return examples, tokens, (largest if tokens is not None and largest[0] else None)


def _add_tokens(total: int, batch: Any) -> int | None:
    """``total`` plus the batch's input tokens (attention-mask ones when given), None for non-token batches."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        return None
    mask = batch.get("attention_mask")
    return total + int(mask.sum()) if isinstance(mask, Tensor) else total + batch["input_ids"].numel()
