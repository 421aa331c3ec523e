"""How a gradient store is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..common.checks import check_fields

STORE_DTYPES = ("float32", "bfloat16", "int8")


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How a gradient store is written (``collect``, ``GradtraceCallback``, ``StoreWriter``, ``ShardWriter``, the
    LESS features, ``TrajectoryWriter``).

    Attributes:
        dtype: storage precision of the vectors; None: float32 for a new store, the spec's for a ``ShardWriter``
            (which refuses another).
        resume, overwrite: add to an existing store (skipping the ids it holds) / replace it; at most one.
        shard_bytes, shard_rows: shard file size (default 256 MiB: as many rows as fit), or rows per shard.
        queue_size: batches of rows buffered for the background writer thread.
        config: extra JSON-able configuration recorded in the store's manifest (Python API only).
    """

    dtype: Literal["float32", "bfloat16", "int8"] | None = field(default=None, metadata={
        "help": "Storage precision of the vectors (int8: one float32 scale per row). Default float32."})
    resume: bool = field(default=False, metadata={
        "help": "Add to an existing store, skipping the ids it already holds."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing store."})
    shard_bytes: int | None = field(default=None, metadata={
        "help": "Bytes per shard file (default 256 MiB): as many rows as fit. A hard kill loses at most one shard.",
        "min": 1})
    shard_rows: int | None = field(default=None, metadata={
        "help": "Rows per shard file, instead of shard_bytes.", "min": 1})
    queue_size: int = field(default=8, metadata={
        "help": "Batches of rows buffered for the background writer thread.", "min": 1})
    config: dict[str, Any] | None = field(default=None, metadata={"python_only": True, "record": False})

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in STORE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {self.dtype!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other; pass one of them")
        if self.config is not None and not isinstance(self.config, dict):
            raise TypeError(f"config must be a dict, got {type(self.config).__name__}")
        check_fields(self)

    @property
    def store_dtype(self) -> str:
        """The storage dtype of a new store: ``dtype``, float32 when None."""
        return self.dtype or "float32"
