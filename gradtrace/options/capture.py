"""What is captured, and how the training loop's loss is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class _ProjectionModule:
    """:mod:`gradtrace.projection`, imported on first attribute access: the annotation ``_projection.LoGra``
    resolves (``typing.get_type_hints``) while importing this module imports no torch (the command line builds its
    ``--help`` from these classes)."""

    def __getattr__(self, name: str) -> Any:
        from .. import projection

        return getattr(projection, name)


_projection = _ProjectionModule()

GRAD_DTYPES = ("float32", "activation")


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """What is captured, and how (see :class:`gradtrace.Capture`; the loss is a :class:`gradtrace.Loss`).

    Attributes:
        layers: module name globs or classes to capture (default: every supported module).
        exclude: module name globs or classes to leave out.
        include_frozen: also capture parameters with ``requires_grad=False``.
        projection: ``gradtrace.LoGra(...)`` (or its dict form) to project each layer at capture time, or None for
            exact gradients. A whole-gradient sketch (:class:`~gradtrace.projection.DenseProjection`,
            :class:`~gradtrace.projection.SparseProjection`) is the projection of
            :func:`gradtrace.less_features` / :func:`gradtrace.less_query_features` (applied to the exact gradients
            they form per batch); capture, collect and the fits refuse it.
        keep_tokens: keep token-level factors (in memory) for per-token scores.
        packing: split packed rows into documents using ``position_ids`` restarts.
        multi_forward: when the model runs several forward calls before one backward: ``"concat"``
            (each call's rows are different examples) or ``"sum"`` (row ``i`` of every call is the
            same example, e.g. two views of it).
        broadcast: ``"expand"`` a layer output computed once for the whole batch (GPT-2's position
            embeddings on a ``[1, T]`` tensor) to one row per example, so it gets per-example
            gradients (values are unchanged); ``"skip"`` to leave such layers out.
        nonfinite: ``"flag"`` examples with NaN/inf gradients in ``batch.nonfinite`` (with a warning)
            or ``"raise"``.
        isolate_padding: replace NaN/inf at positions that belong to no example (padding) by 0 in the
            captured layers' outputs and output-gradients, so that they cannot reach the real tokens (masked
            attention multiplies a padded position's values by 0, which leaves NaN) and flag a whole padded
            batch. Finite values are never changed. Off by default because it changes the loss a training
            loop sees when padding holds NaN; :func:`gradtrace.collect` turns it on.
        partial: allow a capture that leaves out trainable parameters it cannot capture per example (warned, and
            the share captured recorded in the store). Off by default: such a parameter -- a module no rule covers,
            a call whose rows cannot be matched to examples, a parameter used outside its module's forward -- stops
            the capture with a :class:`gradtrace.capture.coverage.CoverageError` naming it and the fixes. Modules
            left out with ``layers`` / ``exclude`` are never an error (they count as "excluded by you").
        verify: check after each backward pass that the per-example gradients, with the loss scale
            put back, sum to the batch gradient autograd computed (debugging; costs a little).
        grad_dtype: the dtype of LoGra's projection products ``a P_a`` and ``g P_g``: ``"float32"`` (a bf16/fp16
            activation or output gradient is upcast, by blocks of rows, and projected in float32) or
            ``"activation"`` (projected in the layer's own dtype, as Bergson does: no float32 copy of the factor,
            each projected value rounded once to that dtype). Either way the projected factors are float32 and
            the per-example sums over tokens are accumulated in float32; with float32 activations the two are the
            same. Needs a projection (exact capture keeps the factors in the activation dtype and forms every
            product in float32).
    """

    layers: Sequence[Any] | None = None
    exclude: Sequence[Any] | None = None
    include_frozen: bool = False
    projection: _projection.LoGra | _projection.Sketch | None = None
    keep_tokens: bool = False
    packing: bool = True
    multi_forward: str = "concat"
    broadcast: str = "expand"
    nonfinite: str = "flag"
    isolate_padding: bool = False
    partial: bool = False
    verify: bool = False
    grad_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {GRAD_DTYPES}, got {self.grad_dtype!r}")
        if self.multi_forward not in ("concat", "sum"):
            raise ValueError(f"multi_forward must be 'concat' or 'sum', got {self.multi_forward!r}")
        if self.broadcast not in ("expand", "skip"):
            raise ValueError(f"broadcast must be 'expand' or 'skip', got {self.broadcast!r}")
        if self.nonfinite not in ("flag", "raise"):
            raise ValueError(f"nonfinite must be 'flag' or 'raise', got {self.nonfinite!r}")
        if self.projection is None:
            return
        if isinstance(self.projection, dict):  # a spec's dict form (a store's manifest records it so)
            kind = _projection.LoGra if self.projection.get("kind") == "logra" else _projection.Sketch
            object.__setattr__(self, "projection", kind.from_dict(self.projection))
        if not isinstance(self.projection, (_projection.LoGra, _projection.Sketch)):
            raise TypeError("projection must be a gradtrace.LoGra spec, a DenseProjection/SparseProjection sketch "
                            f"(less_features) or None, got {type(self.projection).__name__}")
