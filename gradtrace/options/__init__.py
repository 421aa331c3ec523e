"""Typed option objects of the Python API, one per concern, shared by every entry point.

* :class:`CaptureOptions` -- what is captured and how the loop's loss is read (``capture``, ``collect``,
  ``fit_curvature``, ``GradtraceCallback``, ``less_features``/``less_query_features``);
* :class:`StoreOptions` -- how a gradient store is written (``collect``, ``GradtraceCallback``, the LESS
  features, ``TrajectoryWriter``);
* :class:`FitOptions` -- which curvature is fitted and how (``fit_curvature``).

Each entry point takes them as ``options=`` / ``store_options=`` / ``fit_options=`` *and* keeps its keyword
arguments (:func:`takes_options`): a field given both ways is an error; a field the entry point fixes itself
(``collect`` sums per-example losses) must be left at its default. The resolved objects are recorded with
the artifacts (:func:`with_record`: ``config.gradtrace.options`` in a store's ``manifest.json``, in a
curvature's ``meta``), and the command line builds the same objects (``gradtrace.cli``). A field's ``help``
metadata (on the fields the command line exposes) is also their ``--help`` text.

Numeric fields are checked when an object is made (:func:`gradtrace.common.checks.check_fields`: a field's ``min`` /
``max`` / ``valid`` metadata; floats finite), so a bad number is refused before any work, on one line naming it.

This module sits on the floor of the package: it imports only the standard library, :mod:`gradtrace.common` and
(when a projection is given) :mod:`gradtrace.projection`; not torch, so that the command line can build its options
from these fields without it.
"""

from __future__ import annotations

from .base import RECORD_KEY, record, takes_options, with_record
from .capture import EXAMPLE_LOSSES, REDUCTIONS, CaptureOptions
from .fit import CURVATURE_KINDS, FitOptions
from .store import STORE_DTYPES, StoreOptions

__all__ = ["RECORD_KEY", "CaptureOptions", "FitOptions", "StoreOptions", "record", "takes_options", "with_record"]
