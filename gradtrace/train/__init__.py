"""Training-time callbacks: recording what attribution needs from the run (trajectories), and acting on the
per-example gradients while the model trains (online data selection, meta-learned reweighting)."""

from .reweighting import SAMAReweighting, adam_update_jacobian
from .selection import OnlineSelection, SelectionRecord
from .trajectory import TrajectoryWriter

__all__ = ["TrajectoryWriter", "OnlineSelection", "SelectionRecord", "SAMAReweighting", "adam_update_jacobian"]
