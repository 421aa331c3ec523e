"""Per-example gradient containers and the operations on them."""

from .batch import GradBatch, LossConvention, ParamGrad
from .cost import CostModel, MachineProfile
from .ops import concat, inner, sq_norms, token_inner
from .projection import LoGra, Projector
from .quantize import QuantizedRows, quantize, spearman
from .sketch import DenseProjection, SparseProjection
from .terms import DenseTerm, OuterTerm, VectorTerm

__all__ = [
    "CostModel",
    "DenseProjection",
    "DenseTerm",
    "GradBatch",
    "LoGra",
    "LossConvention",
    "MachineProfile",
    "OuterTerm",
    "ParamGrad",
    "Projector",
    "QuantizedRows",
    "SparseProjection",
    "VectorTerm",
    "concat",
    "inner",
    "quantize",
    "spearman",
    "sq_norms",
    "token_inner",
]
