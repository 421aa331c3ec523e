"""Capture per-example gradients from unmodified training loops through hooks."""

from .collector import Capture, CaptureCallback, capture
from .coverage import CaptureReport
from .layer_selection import select_layers

__all__ = ["Capture", "CaptureCallback", "CaptureReport", "capture", "select_layers"]
