"""The loss a Hugging Face Trainer backpropagates, as the capture must undo it.

A captured gradient is the gradient of one example's own loss (gradtrace's loss convention). The Trainer
backpropagates, for each micro-batch ``b`` of an optimizer step (``transformers`` 5)::

    loss_b = (sum of per-token losses of b) / D_b * M / A * S

* ``D_b``: ``num_items_in_batch`` -- the target tokens of *all* micro-batches of the step (summed over
  ranks with ``average_tokens_across_devices``) -- when the Trainer computed it (models that accept loss
  kwargs, or a ``compute_loss_func``); otherwise the micro-batch's own mean, i.e. its target count;
* ``M``: the number of processes when ``average_tokens_across_devices`` multiplies the loss back (it is
  gathered over ranks, and DDP averages gradients), else 1;
* ``A``: the accumulation steps of this optimizer step (fewer for the last one of an epoch) when the loss
  is not already scaled for accumulation (``loss_is_scaled_for_ga``; by default: when ``D_b`` was not
  ``num_items_in_batch``), else 1;
* ``S``: the AMP ``GradScaler`` scale (fp16 on GPU), else 1.

:meth:`TrainerLoss.for_call` evaluates this for one ``compute_loss`` call: the capture is told ``D_b``
(``num_items``; None = count the targets of the call) and ``loss_scale = M / A * S``. The same rules hold
for TRL's trainers, whose ``compute_loss`` reduces the fused LM head's per-token losses the same way.

:func:`loss_ratio` checks the part inside ``compute_loss`` once per run: the value ``compute_loss``
returned against ``M / D_b`` times the sum of the examples' own losses, recomputed from the model's
output (logits or TRL's log-probabilities). A ``compute_loss`` override, a ``compute_loss_func`` or a
model whose loss ignores ``num_items_in_batch`` shows up as a ratio other than 1. (A check on gradients
could not see it: the hook gradients always add up to ``param.grad``, whatever scale is assumed.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..loss.functions import token_log_probs

__all__ = ["CallLoss", "TrainerLoss", "loss_ratio"]


@dataclass
class CallLoss:
    """The Trainer's loss for one ``compute_loss`` call (see the module docstring)."""

    num_items: Tensor | float | None  # D_b, or None: the call's own target count
    world: float  # M
    accumulation: int  # A (1 when the loss is already scaled for accumulation)
    grad_scale: float  # S
    path: str  # which rule applied (recorded in the store's configuration)

    @property
    def scale(self) -> float:
        """``M / A * S``: the capture's ``loss_scale``."""
        return self.world / self.accumulation * self.grad_scale


class TrainerLoss:
    """Derives the scale the Trainer put on each micro-batch's loss (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        args = trainer.args
        if getattr(args, "n_gpu", 1) > 1:
            raise ValueError("gradtrace: the Trainer runs nn.DataParallel (several GPUs in one process), whose "
                             "replicas gradtrace cannot hook; launch with torchrun / accelerate launch (DDP) instead")
        if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError("gradtrace: DeepSpeed scales and partitions gradients inside its engine; it is not "
                             "supported by the Trainer integration (use DDP or FSDP2)")
        self.paths: set[str] = set()

    def _world_multiplier(self) -> int:
        trainer = self.trainer
        if not trainer.args.average_tokens_across_devices:
            return 1
        tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
        return max(1, trainer.accelerator.num_processes // max(1, tp))

    def grad_scaler_scale(self) -> float:
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return 1.0
        return float(scaler.get_scale())

    def for_call(self, num_items_in_batch: Tensor | int | None) -> CallLoss:
        trainer = self.trainer
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = ((trainer.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or trainer.compute_loss_func is not None)
        world = self._world_multiplier() if num_items_in_batch is not None else 1
        accumulation = 1 if scaled else int(trainer.current_gradient_accumulation_steps)
        parts = ["sum / num_items_in_batch" if num_items_in_batch is not None else "micro-batch token mean"]
        if world != 1:
            parts.append("x processes")
        if not scaled:
            parts.append("/ accumulation steps")
        path = " ".join(parts)
        self.paths.add(path)
        return CallLoss(num_items_in_batch, world, accumulation, self.grad_scaler_scale(), path)

    def describe(self) -> dict[str, Any]:
        args = self.trainer.args
        return {"rules": sorted(self.paths), "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "average_tokens_across_devices": bool(args.average_tokens_across_devices),
                "processes": int(self.trainer.accelerator.num_processes),
                "label_smoothing": float(getattr(args, "label_smoothing_factor", 0.0) or 0.0),
                "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else None}


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        return output.get(name) if hasattr(output, "get") else None
    return getattr(output, name, None)


def _losses_total(output: Any, labels: Tensor | None, causal: bool) -> tuple[Tensor, Tensor] | None:
    """``(sum of the examples' own losses, their target count)`` from a model output, or None if unknown."""
    log_probs, mask = _field(output, "log_probs"), _field(output, "label_mask")
    if log_probs is not None and mask is not None:  # TRL's fused LM head: zero where the label is ignored
        return -log_probs.detach().float().sum(), mask.sum()
    logits = _field(output, "logits")
    if logits is None or labels is None or not logits.is_floating_point():
        return None
    # the check runs while the training graph (and the logits) are alive: no float32 copy of [B, T, V] -- the
    # log-sum-exp runs in float32 over row blocks of the logits as they are (token_log_probs)
    logits, labels = logits.detach(), labels.to(logits.device)
    if causal and labels.dim() == 2 and logits.dim() == 3 and logits.shape[:2] == labels.shape:
        # position t predicts labels[t + 1]: shift the labels, not the logits (a slice of them would be copied)
        labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    if labels.is_floating_point() or logits.shape[:-1] != labels.shape:
        return None
    log_probs = token_log_probs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long())  # 0: ignored
    return -log_probs.sum(), (labels != -100).sum()


def loss_ratio(value: Tensor, output: Any, labels: Tensor | None, call: CallLoss, causal: bool) -> float | None:
    """``compute_loss``'s value over what the derived convention predicts (1 = right); None if not checkable."""
    found = _losses_total(output, labels, causal)
    if found is None:
        return None
    total, count = found
    denominator = float(call.num_items) if call.num_items is not None else max(float(count), 1.0)
    expected = float(total) * call.world / denominator
    return float(value.detach().float()) / expected if expected != 0 else None
