"""How a gradient store is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..common.checks import check_fields

STORE_DTYPES = ("float32", "bfloat16", "int8")


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How a gradient store is written (see :class:`gradtrace.store.ShardWriter`)."""

    dtype: Literal["float32", "bfloat16", "int8"] = field(default="float32", metadata={
        "help": "Storage precision of the vectors (int8: one float32 scale per row)."})
    resume: bool = field(default=False, metadata={
        "help": "Add to an existing store, skipping the ids it already holds."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing store."})
    shard_bytes: int | None = field(default=None, metadata={
        "help": "Bytes per shard file (default 256 MiB): as many rows as fit. A hard kill loses at most one shard.",
        "min": 1})
    shard_rows: int | None = field(default=None, metadata={
        "help": "Rows per shard file, instead of shard_bytes.", "min": 1})

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {self.dtype!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other; pass one of them")
        check_fields(self)
