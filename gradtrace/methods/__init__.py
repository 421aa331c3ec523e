"""Attribution methods (one file each) and their registry."""

from .base import Method, MissingStage, available_methods, get_method, register_method
from .dvemb import DVEmb as DVEmb
from .influence import EKFAC, GGN, KFAC, LoGraInfluence
from .less import Less as Less
from .similarity import GradCos, GradDot
from .tracin import TracIn

__all__ = [
           "GradCos",
           "GradDot",
           "Method",
           "MissingStage",
           "TracIn", "KFAC", "EKFAC", "GGN", "LoGraInfluence",
           "available_methods",
           "get_method",
           "register_method",
]
