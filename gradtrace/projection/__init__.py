"""Random and learned projections of gradients: LoGra (per-layer factor projections applied at capture) and the
dense/sparse sketches of whole flattened gradients (used by LESS)."""

from .logra import LoGra, Projector
from .sketch import DenseProjection, Sketch, SparseProjection

__all__ = ["DenseProjection", "LoGra", "Projector", "Sketch", "SparseProjection"]
