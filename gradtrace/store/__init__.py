"""Sharded, memory-mapped, self-describing on-disk gradient stores (pure I/O: no capture, no collectives).

``StoreWriter``, the capture callback that writes a store, lives in :mod:`gradtrace.capture.sink` and is still
importable from here.
"""

from typing import Any

from .layout import StoreError
from .reader import GradientStore
from .spec import GradientSpec, IdCollision, SpecMismatch, model_fingerprint
from .writer import ShardWriter, StoreWriteError

__all__ = [
    "GradientSpec",
    "GradientStore",
    "IdCollision",
    "ShardWriter",
    "SpecMismatch",
    "StoreError",
    "StoreWriteError",
    "StoreWriter",
    "model_fingerprint",
]


def __getattr__(name: str) -> Any:
    """``gradtrace.store.StoreWriter`` (its public name before the sink layer), resolved on first use so that the
    store package imports nothing above it."""
    if name == "StoreWriter":
        from ..capture.sink import StoreWriter

        return StoreWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
