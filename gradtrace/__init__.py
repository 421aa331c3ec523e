"""gradtrace: training data attribution for language models.

Which training examples made my model do this? ``gradtrace.capture`` records per-example gradients
from an unmodified training loop; later stages store, precondition and score them.
"""

from .capture import Capture, CaptureCallback, CaptureReport, capture
from .grad import GradBatch, LoGra, LossConvention, ParamGrad

__version__ = "0.1.0"

__all__ = [
           "Capture",
           "CaptureCallback",
           "CaptureReport",
           "GradBatch",
           "LoGra",
           "LossConvention",
           "ParamGrad",
           "__version__",
           "capture",
]
