"""The loss a captured gradient is the gradient of, and how the training loop reduced it (the Task-like object)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..common.checks import nonzero
from .base import _choice

REDUCTIONS = ("mean", "sum", "token_mean")
EXAMPLE_LOSSES = ("sum", "mean")


@dataclass(frozen=True, kw_only=True)
class Loss:
    """Everything gradtrace needs to know about a loss, in one object (``gradtrace.Loss``).

    Attributes:
        fn: ``fn(model, batch) -> [B]`` per-example losses, for the passes gradtrace runs itself (``collect``,
            ``fit_curvature``, the LESS features). None: :func:`gradtrace.loss.functions.causal_lm_loss` (sum over
            target tokens) for dicts with ``input_ids``, else per-example cross-entropy. A plain callable given
            where a ``Loss`` is expected means ``Loss(fn=callable)``.
        reduction: how a training loop combined per-example losses into the loss it backpropagates (read by
            ``capture`` and ``GradtraceCallback``): ``"mean"`` over rows, ``"sum"``, or ``"token_mean"`` (Hugging
            Face: the target-token sum over the batch divided by their count or ``num_items_in_batch``). None: the
            entry point's default (``"mean"`` for ``capture``; derived from the Trainer by ``GradtraceCallback``).
        example_loss: the loss each captured gradient belongs to: ``"sum"`` over the example's target tokens
            (default) or their ``"mean"``.
        scale: any other constant the loop multiplied its loss by (``1/accumulation_steps``, an AMP
            ``GradScaler`` scale): finite and not 0 (gradients are divided by it); a callable is evaluated at every
            forward call. None: 1 (derived from the Trainer by ``GradtraceCallback``).
        causal_lm: whether labels are shifted by one (logits at ``t`` predict ``labels[t+1]``); None: inferred
            from the model class name (``*ForCausalLM``, ``*LMHeadModel``).
        ignore_index: the label value that marks non-target tokens.
        likelihood: for a custom ``fn``, the distribution of the model's outputs that a true Fisher samples labels
            from (:func:`gradtrace.loss.likelihoods.categorical`, ``gaussian``).
        check: where the entry point can (``GradtraceCallback``'s first captured micro-batch), check that the loss
            the loop backpropagates equals the examples' own losses combined as stated; raise if not.
    """

    fn: Callable[..., Any] | None = None
    reduction: str | None = None
    example_loss: str = "sum"
    scale: float | Callable[[], float] | None = None
    causal_lm: bool | None = None
    ignore_index: int = -100
    likelihood: Any = None
    check: bool = True

    def __post_init__(self) -> None:
        if self.fn is not None and not callable(self.fn):
            raise TypeError(f"Loss.fn must be a callable fn(model, batch) -> [B], got {type(self.fn).__name__}")
        if self.reduction is not None:
            _choice(self.reduction, "reduction", REDUCTIONS)
        _choice(self.example_loss, "example_loss", EXAMPLE_LOSSES)
        if self.scale is not None and not callable(self.scale):  # a 0-dim tensor too: as its float
            scale = self.scale
            nonzero(float(scale) if hasattr(scale, "__float__") and not isinstance(scale, bool) else scale, "scale")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an integer, got {self.ignore_index!r}")

    def summed(self, what: str) -> Loss:
        """This loss for a pass gradtrace runs itself (``what``: the entry point), which sums each example's loss
        over its target tokens and backpropagates it: a reduction, a scale or a per-token mean is refused."""
        if self.reduction is not None or self.scale is not None or self.example_loss != "sum":
            raise ValueError(f"{what} sums each example's loss over its target tokens and runs the backward itself: "
                             "leave Loss.reduction, Loss.scale and Loss.example_loss at their defaults")
        return self

    @classmethod
    def of(cls, loss: Loss | Callable[..., Any] | None) -> Loss:
        """``loss`` as a :class:`Loss`: itself, ``Loss(fn=loss)`` for a plain callable, ``Loss()`` for None."""
        if loss is None:
            return cls()
        if isinstance(loss, cls):
            return loss
        if callable(loss):
            return cls(fn=loss)
        raise TypeError(f"loss must be a gradtrace.Loss, a callable fn(model, batch) -> [B] or None, got "
                        f"{type(loss).__name__}")
