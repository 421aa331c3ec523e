"""Attribution methods (one file each) and their registry."""

from .base import Method, MissingStage, available_methods, get_method, method_class, register_method
from .dvemb import DVEmb as DVEmb
from .influence import EKFAC, GGN, KFAC, LoGraInfluence
from .less import Less as Less
from .saved import FitError, load_fit, save_fit, saves_fit
from .similarity import GradCos, GradDot
from .tracin import TracIn
from .trackstar import TrackStar
from .trak import TRAK
from .whole_model import Arnoldi, ConjugateGradient, DenseGGN

__all__ = [
           "GradCos",
           "GradDot",
           "Method",
           "MissingStage",
           "TracIn", "KFAC", "EKFAC", "GGN", "LoGraInfluence", "Arnoldi", "ConjugateGradient", "DenseGGN",
           "TRAK", "TrackStar",
           "available_methods",
           "get_method", "method_class", "FitError", "load_fit", "save_fit", "saves_fit",
           "register_method",
]
