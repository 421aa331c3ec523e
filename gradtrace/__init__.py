"""gradtrace: training data attribution for language models.

Which training examples made my model do this? ``gradtrace.capture`` records per-example gradients from an
unmodified training loop (or ``gradtrace.collect`` from a dataset at fixed weights), a ``GradientStore``
keeps them on disk, and an ``Attributor`` scores queries against them.

Sign convention everywhere: a positive score means the training example helps the query (lowers its loss).
"""

from .capture import Capture, CaptureCallback, CaptureReport, capture
from .collect import collect
from .grad import GradBatch, LoGra, LossConvention, ParamGrad
from .gradients import GradientSet
from .methods import available_methods
from .score import Attributor, Scores
from .store import GradientSpec, GradientStore, StoreWriter

__version__ = "0.1.0"

__all__ = [
           "Attributor",
           "Capture",
           "CaptureCallback",
           "CaptureReport",
           "GradBatch",
           "GradientSet",
           "GradientSpec",
           "GradientStore",
           "LoGra",
           "LossConvention",
           "ParamGrad",
           "Scores",
           "StoreWriter",
           "__version__",
           "available_methods",
           "capture",
           "collect",
]
