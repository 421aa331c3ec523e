"""Per-example loss functions for :func:`gradtrace.collect` (``loss_fn(model, batch) -> [B]``)."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["causal_lm_loss", "classification_loss", "lm_labels"]

_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")


def lm_labels(batch: dict[str, Tensor], ignore_index: int = -100) -> Tensor:
    """``batch["labels"]``, or the input ids with padding (``attention_mask == 0``) ignored."""
    if batch.get("labels") is not None:
        return batch["labels"]
    labels = batch["input_ids"].clone()
    if batch.get("attention_mask") is not None:
        labels = labels.masked_fill(batch["attention_mask"] == 0, ignore_index)
    return labels


def causal_lm_loss(model: nn.Module, batch: dict[str, Any], *, mean: bool = False,
                   ignore_index: int = -100) -> Tensor:
    """Per-row next-token loss of a causal LM: the sum over target tokens (``mean=True``: their mean).

    ``batch`` holds ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels``
    (``ignore_index`` = not a target; default: every non-padding token after the first).
    """
    labels = lm_labels(batch, ignore_index)
    kwargs = {k: batch[k] for k in _MODEL_KEYS if batch.get(k) is not None}
    logits = model(**kwargs).logits
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    per_token = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=ignore_index,
                                reduction="none")
    total = per_token.sum(1)
    if mean:
        total = total / (shift_labels != ignore_index).sum(1).clamp(min=1)
    return total


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Per-example cross-entropy for ``(inputs, targets)`` batches or dicts with ``labels``."""
    if isinstance(batch, dict):
        targets = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "id")})
        logits = getattr(logits, "logits", logits)
    else:
        inputs, targets = batch
        logits = model(inputs)
    return F.cross_entropy(logits, targets, reduction="none")


def default_loss(batch: Any):
    """The loss :func:`gradtrace.collect` uses when none is given, judged from the batch's form: causal LM
    for dicts with ``input_ids`` (and token-level or no ``labels``), classification otherwise."""
    if isinstance(batch, dict) and "input_ids" in batch:
        labels = batch.get("labels")
        if labels is None or labels.dim() == 2:
            return causal_lm_loss
    return classification_loss
