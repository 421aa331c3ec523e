"""Which labels the Fisher is taken over: observed ("empirical"), sampled from the model ("true"), or every
label weighted by its probability ("exact", classification only: equal to the Gauss-Newton matrix).
``"auto"`` (:func:`resolve_fisher`) picks ``"exact"`` for gradtrace's classification and regression losses with
at most :data:`EXACT_MAX_OUTPUTS` outputs, ``"true"`` for LMs and wider outputs and ``"empirical"`` for custom
losses: one sampled label per output is a noisy
estimate when an example has a single output (a sequence averages it over its tokens), and the exact
expectation costs one pass per class.

Each returns the per-example loss functions of the fitting passes; their gradients' second moments, summed
over passes, estimate the chosen Fisher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses import (
    MODEL_KEYS,
    LossFn,
    causal_lm_loss,
    classification_loss,
    default_loss,
    lm_labels,
    regression_loss,
    token_cross_entropy,
)

__all__ = ["fisher_passes", "FISHERS", "EXACT_MAX_OUTPUTS", "num_classes_of", "resolve_fisher"]

FISHERS = ("empirical", "true", "exact")
EXACT_MAX_OUTPUTS = 32  # fisher="auto" enumerates labels (one fitting pass each) up to this many outputs


def _kind(loss_fn: LossFn | None) -> str:
    if loss_fn is causal_lm_loss:
        return "lm"
    if loss_fn is classification_loss:
        return "cls"
    if loss_fn is regression_loss:
        return "reg"
    return "custom"


def _sampled_lm(generator: torch.Generator, weight: float) -> LossFn:
    def loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
        labels = lm_labels(batch)
        logits = model(**{k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}).logits
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1).to(logits.device)
        with torch.no_grad():
            probs = torch.softmax(logits.float().flatten(0, 1), dim=-1)
            sampled = torch.multinomial(probs.cpu(), 1, generator=generator).view(targets.shape).to(targets.device)
        sampled = torch.where(targets != -100, sampled, targets)
        per_token = token_cross_entropy(logits.flatten(0, 1), sampled.flatten()).view(targets.shape)
        return per_token.sum(1) * weight

    return loss


def _split(batch: Any) -> tuple[Any, Tensor | None]:
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k not in ("labels", "id")}, batch.get("labels")
    return batch[0], batch[1]


def _logits(model: nn.Module, inputs: Any) -> Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return getattr(out, "logits", out)


def _sampled_cls(generator: torch.Generator, weight: float) -> LossFn:
    def loss(model: nn.Module, batch: Any) -> Tensor:
        inputs, _ = _split(batch)
        logits = _logits(model, inputs)
        with torch.no_grad():
            sampled = torch.multinomial(torch.softmax(logits.float(), -1).cpu(), 1, generator=generator).view(-1)
        return F.cross_entropy(logits, sampled.to(logits.device), reduction="none") * weight

    return loss


def _sampled_reg(generator: torch.Generator, weight: float) -> LossFn:
    """Gaussian likelihood with unit variance: y ~ N(f(x), I), so the output-gradient is -noise."""
    def loss(model: nn.Module, batch: Any) -> Tensor:
        inputs, _ = _split(batch)
        outputs = _logits(model, inputs)
        noise = torch.randn(outputs.shape, generator=generator).to(outputs.device, outputs.dtype)
        target = (outputs.detach() + noise)
        return 0.5 * (outputs - target).reshape(outputs.shape[0], -1).pow(2).sum(1) * weight

    return loss


def _output_coordinate(index: int) -> LossFn:
    """Exact Gauss-Newton of a squared error: the output Hessian is I, so sum over output coordinates."""
    def loss(model: nn.Module, batch: Any) -> Tensor:
        inputs, _ = _split(batch)
        outputs = _logits(model, inputs)
        return outputs.reshape(outputs.shape[0], -1)[:, index]

    return loss


def _label_cls(label: int) -> LossFn:
    def loss(model: nn.Module, batch: Any) -> Tensor:
        inputs, _ = _split(batch)
        logits = _logits(model, inputs)
        target = torch.full((logits.shape[0],), label, dtype=torch.long, device=logits.device)
        weight = torch.softmax(logits.detach().float(), -1)[:, label].sqrt()
        return F.cross_entropy(logits, target, reduction="none") * weight

    return loss


def fisher_passes(loss_fn: LossFn | None, fisher: str, sample_batch: Any, *, samples: int = 1, seed: int = 0,
                  num_classes: int | None = None) -> list[LossFn]:
    """The per-pass loss functions estimating the ``fisher`` of ``loss_fn`` (see module docstring)."""
    if fisher not in FISHERS:
        raise ValueError(f"fisher must be one of {(*FISHERS, 'auto')}, got {fisher!r}")
    fn = loss_fn or default_loss(sample_batch)
    if fisher == "empirical":
        return [fn]
    kind = _kind(fn)
    if kind == "custom":
        raise ValueError(f"fisher={fisher!r} needs labels sampled from the model, which gradtrace knows how to do for "
                         "gradtrace.losses.causal_lm_loss, classification_loss and regression_loss; use one of "
                         "them or "
                         "fisher='empirical'")
    if fisher == "exact":
        if kind == "reg":
            if num_classes is None:
                raise ValueError("fisher='exact' needs the output width")
            return [_output_coordinate(c) for c in range(num_classes)]
        if kind != "cls":
            raise ValueError("fisher='exact' enumerates every label: classification and regression models only "
                             "(use 'true' for LMs)")
        if num_classes is None:
            raise ValueError("fisher='exact' needs num_classes=")
        return [_label_cls(c) for c in range(num_classes)]
    generator = torch.Generator().manual_seed(seed)
    weight = 1.0 / samples ** 0.5
    make = {"lm": _sampled_lm, "cls": _sampled_cls, "reg": _sampled_reg}[kind]
    return [make(generator, weight) for _ in range(samples)]


def resolve_fisher(fisher: str, loss_fn: LossFn | None, model: nn.Module,
                   sample_batch: Any) -> tuple[str, int | None]:
    """The Fisher to fit (``"auto"`` resolved) and, when it is ``"exact"``, the number of outputs it enumerates
    (one no-grad forward pass on ``sample_batch``; None otherwise).

    ``"auto"`` is ``"exact"`` for :func:`~gradtrace.losses.classification_loss` / ``regression_loss`` with at most
    :data:`EXACT_MAX_OUTPUTS` outputs (one pass per output), ``"true"`` (sampled labels) for larger ones and
    for :func:`~gradtrace.losses.causal_lm_loss`, ``"empirical"`` for a custom loss (gradtrace knows no
    likelihood to sample its labels from). The fitted curvature's ``fisher`` records the choice.
    """
    if fisher == "auto":
        kind = _kind(loss_fn or default_loss(sample_batch))
        if kind in ("custom", "lm"):
            return ("empirical" if kind == "custom" else "true"), None
        outputs = num_classes_of(model, sample_batch)
        return ("exact", outputs) if outputs <= EXACT_MAX_OUTPUTS else ("true", None)
    return fisher, num_classes_of(model, sample_batch) if fisher == "exact" else None


def num_classes_of(model: nn.Module, batch: Any) -> int:
    """Width of a classifier's logits, from one no-grad forward pass on ``batch`` (its labels and ids unused)."""
    inputs, _ = _split(batch)
    with torch.no_grad():
        out = _logits(model, inputs)
        return int(out.reshape(out.shape[0], -1).shape[1])
