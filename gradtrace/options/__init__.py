"""Typed option objects: the only way to configure gradtrace's entry points, one object per concern.

* :class:`Loss` -- the loss a gradient belongs to and how the training loop reduced it (``gradtrace.Loss``, the
  Task-like object: the function, reduction, per-example loss, scale, label layout, likelihood);
* :class:`CaptureOptions` -- what is captured and how (``capture``, ``collect``, ``fit_curvature``,
  ``GradtraceCallback``, the LESS features);
* :class:`StoreOptions` -- how a gradient store is written (``collect``, ``GradtraceCallback``, ``StoreWriter``,
  ``ShardWriter``, ``TrajectoryWriter``, the LESS features);
* :class:`FitOptions` -- which curvature is fitted and how (``fit_curvature``);
* :class:`RunOptions` -- how gradtrace's own passes run the data (ids, device, eval mode, progress, model dtype);
* :class:`Fields`, :class:`ReadOptions`, :class:`BatchOptions` -- which fields of a record hold what, how records
  become tokens, how tokens become batches (``gradtrace.data.load``);
* :class:`IndexOptions`, :class:`SearchOptions` -- how an index is built and searched (``build_index``,
  ``score_with_index``);
* :class:`ReportOptions` -- what a report shows (``build_report``, ``render_report``, ``Scores.to_html``);
* :class:`SelectionOptions`, :class:`ReweightingOptions` -- online data selection and SAMA reweighting;
* :class:`LDSOptions` -- how LDS ground truth is made (``build_lds_ground_truth``);
* :class:`MetagradOptions` -- how metagradients replay a recorded run (``gradtrace.replay.metagradients``).

An entry point takes its inputs (model, data, loss, paths) and these objects; no setting is also a keyword, so a
setting is given one way only. Objects are frozen and checked when made (:func:`gradtrace.common.checks.check_fields`:
a field's ``min`` / ``max`` / ``valid`` metadata, floats finite; choices by name), so a bad value is refused before
any work, on one line naming it. Artifacts record the resolved objects (:func:`with_record`:
``config.gradtrace.options`` in a store's ``manifest.json``, a curvature's ``meta``), and the command line builds the
same objects from its flags (a field's ``help`` metadata is its ``--help`` text; ``python_only`` fields have no flag).

The package sits low (it imports only the standard library, :mod:`gradtrace.common` and, when a projection is
given, :mod:`gradtrace.projection`; not torch), so the command line can build its ``--help`` from these fields.
"""

from __future__ import annotations

from .base import RECORD_KEY, record, with_record
from .capture import CaptureOptions
from .data import BatchOptions, Fields, ReadOptions
from .eval import LDSOptions
from .fit import FitOptions
from .index import IndexOptions, SearchOptions
from .loss import Loss
from .replay import MetagradOptions
from .report import ReportOptions
from .run import RunOptions
from .store import StoreOptions
from .train import ReweightingOptions, SelectionOptions

__all__ = ["RECORD_KEY", "BatchOptions", "CaptureOptions", "Fields", "FitOptions", "IndexOptions", "LDSOptions", "Loss",
           "MetagradOptions", "ReadOptions", "ReportOptions", "ReweightingOptions", "RunOptions", "SearchOptions",
           "SelectionOptions", "StoreOptions", "record", "with_record"]
