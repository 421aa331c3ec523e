"""Per-example gradient containers and the operations on them."""

from .batch import GradBatch, LossConvention, ParamGrad
from .projection import LoGra, Projector
from .terms import DenseTerm, OuterTerm, VectorTerm

__all__ = ["GradBatch", "ParamGrad", "LossConvention", "LoGra", "Projector", "OuterTerm", "VectorTerm", "DenseTerm"]
