"""Training-time recording: what attribution methods need from the training run itself."""

from .trajectory import TrajectoryWriter

__all__ = ["TrajectoryWriter"]
