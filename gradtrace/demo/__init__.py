"""The bundled demo: ``gradtrace demo`` / ``make demo`` (see :mod:`gradtrace.demo.run`)."""

from .run import main, run

__all__ = ["main", "run"]
