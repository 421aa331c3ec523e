"""Capture per-example gradients from unmodified training loops through hooks."""

from .collector import Capture, CaptureCallback, capture
from .report import CaptureReport
from .selection import select_layers

__all__ = ["Capture", "CaptureCallback", "CaptureReport", "capture", "select_layers"]
