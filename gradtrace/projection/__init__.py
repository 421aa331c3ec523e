"""Random and learned projections of gradients: LoGra (per-layer factor projections applied at capture) and the
dense/sparse sketches of whole flattened gradients (used by LESS), under one :class:`Projection` protocol whose
specs :func:`projection_from_dict` rebuilds by kind."""

from .base import Projection, ProjectionError, projection_from_dict, register_projection
from .logra import LoGra, PCABasis, Projector
from .sketch import DenseProjection, Sketch, SparseProjection

__all__ = ["DenseProjection", "LoGra", "PCABasis", "Projection", "ProjectionError", "Projector", "Sketch",
           "SparseProjection", "projection_from_dict", "register_projection"]
