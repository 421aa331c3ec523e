"""What is captured, and how the training loop's loss is read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..common.checks import nonzero
from .base import _choice

REDUCTIONS = ("mean", "sum", "token_mean")
EXAMPLE_LOSSES = ("sum", "mean")


class _LoGraModule:
    """:mod:`gradtrace.projection.logra`, imported on first attribute access: the annotation ``_logra.LoGra``
    resolves (``typing.get_type_hints``) while importing this module imports no torch (the command line builds its
    ``--help`` from these classes)."""

    def __getattr__(self, name: str) -> Any:
        from ..projection import logra

        return getattr(logra, name)


_logra = _LoGraModule()



@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """What is captured, and how the training loop's loss is read (see :class:`gradtrace.Capture`).

    Attributes:
        layers: module name globs or classes to capture (default: every supported module).
        exclude: module name globs or classes to leave out.
        include_frozen: also capture parameters with ``requires_grad=False``.
        reduction: how the loop reduced per-example losses into the loss it backpropagates:
            ``"mean"`` over rows, ``"sum"``, or ``"token_mean"`` (Hugging Face: target-token sum over
            the batch divided by their count or ``num_items_in_batch``); None: the entry point's default
            (``"mean"`` for ``capture``, derived from the Trainer by ``GradtraceCallback``).
        example_loss: the loss each captured gradient belongs to: ``"sum"`` over the example's target
            tokens (default) or the per-token ``"mean"``.
        loss_scale: any other constant the loop multiplied its loss by (e.g. ``1/accumulation_steps``,
            an AMP ``GradScaler`` scale): finite and not 0, since gradients are divided by it; a callable is evaluated
            at every forward call (its value checked likewise); None: 1 (derived from the Trainer by
            ``GradtraceCallback``).
        projection: ``gradtrace.LoGra(...)`` (or its dict form) to project at capture time, or None for exact
            gradients.
        packing: split packed rows into documents using ``position_ids`` restarts.
        multi_forward: when the model runs several forward calls before one backward: ``"concat"``
            (each call's rows are different examples) or ``"sum"`` (row ``i`` of every call is the
            same example, e.g. two views of it).
        broadcast: ``"expand"`` a layer output computed once for the whole batch (GPT-2's position
            embeddings on a ``[1, T]`` tensor) to one row per example, so it gets per-example
            gradients (values are unchanged); ``"skip"`` to leave such layers out.
        causal_lm: whether labels are shifted by one (logits at ``t`` predict ``labels[t+1]``); by
            default inferred from the model class name (``*ForCausalLM``, ``*LMHeadModel``).
        ignore_index: label value that marks non-target tokens.
        nonfinite: ``"flag"`` examples with NaN/inf gradients in ``batch.nonfinite`` (with a warning)
            or ``"raise"``.
        isolate_padding: replace NaN/inf at positions that belong to no example (padding) by 0 in the
            captured layers' outputs and output-gradients, so that they cannot reach the real tokens (masked
            attention multiplies a padded position's values by 0, which leaves NaN) and flag a whole padded
            batch. Finite values are never changed. Off by default because it changes the loss a training
            loop sees when padding holds NaN; :func:`gradtrace.collect` turns it on.
        strict: raise instead of warning when trainable parameters cannot be captured.
        verify: check after each backward pass that the per-example gradients, with the loss scale
            put back, sum to the batch gradient autograd computed (debugging; costs a little).
    """

    layers: Sequence[Any] | None = None
    exclude: Sequence[Any] | None = None
    include_frozen: bool = False
    projection: _logra.LoGra | None = None
    reduction: str | None = None
    example_loss: str = "sum"
    loss_scale: float | Callable[[], float] | None = None
    packing: bool = True
    multi_forward: str = "concat"
    broadcast: str = "expand"
    causal_lm: bool | None = None
    ignore_index: int = -100
    nonfinite: str = "flag"
    isolate_padding: bool = False
    strict: bool = False
    verify: bool = False

    def __post_init__(self) -> None:
        if self.reduction is not None:
            _choice(self.reduction, "reduction", REDUCTIONS)
        _choice(self.example_loss, "example_loss", EXAMPLE_LOSSES)
        if self.multi_forward not in ("concat", "sum"):
            raise ValueError(f"multi_forward must be 'concat' or 'sum', got {self.multi_forward!r}")
        if self.broadcast not in ("expand", "skip"):
            raise ValueError(f"broadcast must be 'expand' or 'skip', got {self.broadcast!r}")
        if self.nonfinite not in ("flag", "raise"):
            raise ValueError(f"nonfinite must be 'flag' or 'raise', got {self.nonfinite!r}")
        if self.loss_scale is not None and not callable(self.loss_scale):  # a 0-dim tensor too: as its float
            scale = self.loss_scale
            nonzero(float(scale) if hasattr(scale, "__float__") and not isinstance(scale, bool) else scale,
                    "loss_scale")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an integer, got {self.ignore_index!r}")
        if self.projection is None:
            return
        if isinstance(self.projection, dict):  # a spec's dict form (a store's manifest records it so)
            object.__setattr__(self, "projection", _logra.LoGra.from_dict(self.projection))
        if not isinstance(self.projection, _logra.LoGra):
            raise TypeError(f"projection must be a gradtrace.LoGra spec or None, got "
                            f"{type(self.projection).__name__}")
