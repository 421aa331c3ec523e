"""Per-example gradient containers and the operations on them."""

from .batch import GradientBatch, ParamGradient
from .cost import CostModel, MachineProfile
from .ops import concat, inner, sq_norms, token_inner
from .quantize import QuantizedRows, quantize, spearman
from .terms import DenseTerm, OuterTerm, VectorTerm

__all__ = [
    "CostModel",
    "DenseTerm",
    "GradientBatch",
    "MachineProfile",
    "OuterTerm",
    "ParamGradient",
    "QuantizedRows",
    "VectorTerm",
    "concat",
    "inner",
    "quantize",
    "spearman",
    "sq_norms",
    "token_inner",
]
