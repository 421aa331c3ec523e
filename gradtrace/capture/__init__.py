"""Capture per-example gradients from unmodified training loops through hooks."""

from .collector import Capture, CaptureCallback, capture
from .layer_selection import select_layers
from .report import CaptureReport

__all__ = ["Capture", "CaptureCallback", "CaptureReport", "capture", "select_layers"]
