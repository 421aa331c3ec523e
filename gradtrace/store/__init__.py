"""Sharded, memory-mapped, self-describing on-disk gradient stores."""

from .layout import StoreError
from .reader import GradientStore
from .spec import GradientSpec, IdCollision, SpecMismatch, model_fingerprint
from .writer import ShardWriter, StoreWriteError, StoreWriter

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
