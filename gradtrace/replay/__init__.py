"""Near-exact data attribution by differentiating through a recorded training run (metagradients, REPLAY).

Record a plain loop with :class:`RunRecorder`, read it back with :func:`load_run`, check it with :func:`replay`
and differentiate a query's final loss with respect to every training example's weight with
:func:`metagradients` (``scores[q, i] = -dL_q / dw_i``: positive means the example helps the query).
See docs/metagradients.md.
"""

from .metagrad import MetaGradients, metagradients
from .optim import OptimState, clip_grad_norm, optimizer_step
from .record import RunRecorder
from .replay import ReplayResult, replay
from .run import RecordedRun, load_run
from .smoothness import SmoothnessReport, metasmoothness
from .spec import Reduction, ReplayError

__all__ = ["metagradients", "MetaGradients", "RunRecorder", "Reduction", "ReplayError", "RecordedRun", "load_run",
           "replay", "ReplayResult", "OptimState", "optimizer_step", "clip_grad_norm", "metasmoothness",
           "SmoothnessReport"]
