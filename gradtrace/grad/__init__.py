"""Per-example gradient containers and the operations on them."""

from ..loss.functions import LossConvention
from .batch import GradientBatch, ParamGradient
from .cost import CostModel, MachineProfile
from .ops import concat, inner, sq_norms, token_inner
from .quantize import QuantizedRows, quantize, spearman
from .terms import DenseTerm, OuterTerm, VectorTerm

# The names before the architecture step (issue #16); kept so that existing code keeps working.
GradBatch = GradientBatch
ParamGrad = ParamGradient

__all__ = [
    "CostModel",
    "DenseTerm",
    "GradBatch",
    "GradientBatch",
    "LossConvention",
    "MachineProfile",
    "OuterTerm",
    "ParamGrad",
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
