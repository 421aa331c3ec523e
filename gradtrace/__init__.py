"""gradtrace: training data attribution for language models.

Which training examples made my model do this? ``gradtrace.capture`` records per-example gradients from an
unmodified training loop (or ``gradtrace.collect`` from a dataset at fixed weights), a ``GradientStore``
keeps them on disk, and an ``Attributor`` scores queries against them.

Sign convention everywhere: a positive score means the training example helps the query (lowers its loss).
"""

from .capture import Capture, CaptureCallback, CaptureReport, capture
from .capture.checkpoints import collect_checkpoints
from .capture.collect import collect
from .capture.gradient_set import GradientSet
from .capture.sink import StoreWriter
from .grad import GradientBatch, ParamGradient
from .loss.functions import LossConvention
from .methods import available_methods
from .methods.dvemb import data_value_embeddings
from .methods.less import less_features, less_query_features
from .methods.saved import load_fit, save_fit
from .plan import FitPlan, Plan, ScorePlan, plan, plan_fit, plan_score
from .projection import LoGra
from .score import Attributor, Ensemble, Scores, Unrolled
from .store import GradientSpec, GradientStore
from .train import TrajectoryWriter
from .version import __version__

# The names before the architecture step (issue #16); kept so that existing code keeps working.
GradBatch = GradientBatch
ParamGrad = ParamGradient

__all__ = [
    "capture", "Capture", "CaptureCallback", "CaptureReport", "collect", "GradientBatch", "ParamGradient", "LoGra",
    "LossConvention", "GradientSet", "GradientStore", "GradientSpec", "StoreWriter", "Attributor", "Scores",
    "available_methods", "less_features", "less_query_features", "data_value_embeddings", "TrajectoryWriter",
    "plan", "Plan", "plan_fit", "FitPlan", "plan_score", "ScorePlan", "__version__", "GradBatch", "ParamGrad",
    "Ensemble", "Unrolled", "collect_checkpoints", "load_fit", "save_fit",
]
