"""The version of gradtrace, on the bottom floor so that artifacts and commands can record it without importing the
whole package (``gradtrace.__version__`` is this one)."""

__version__ = "0.1.0"
