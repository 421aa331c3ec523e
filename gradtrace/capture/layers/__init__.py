"""Per-layer gradient math, one file per layer kind; importing this package registers them all."""

from .attention_sinks import AttentionSinksHandler
from .base import LayerHandler, find_handler, register_layer, registered_handlers
from .conv import ConvHandler
from .embedding import EmbeddingHandler
from .experts import ExpertsHandler
from .linear import LinearHandler
from .norm import NormHandler
from .router import RouterHandler

__all__ = [
    "AttentionSinksHandler",
    "ConvHandler",
    "EmbeddingHandler",
    "ExpertsHandler",
    "LayerHandler",
    "LinearHandler",
    "NormHandler",
    "RouterHandler",
    "find_handler",
    "register_layer",
    "registered_handlers",
]
