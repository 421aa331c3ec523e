"""Per-layer gradient math, one file per layer kind; importing this package registers them all."""

from .base import LayerHandler, find_handler, register_layer, registered_handlers
from .conv import ConvHandler
from .embedding import EmbeddingHandler
from .linear import LinearHandler
from .norm import NormHandler

__all__ = [
    "ConvHandler",
    "EmbeddingHandler",
    "LayerHandler",
    "LinearHandler",
    "NormHandler",
    "find_handler",
    "register_layer",
    "registered_handlers",
]
