"""The ``gradtrace`` command line (``gradtrace --help``; ``python -m gradtrace.cli``)."""

from .main import app, main

__all__ = ["app", "main"]
