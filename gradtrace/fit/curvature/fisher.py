"""Which labels the Fisher is taken over: observed ("empirical"), sampled from the model ("true"), or every
label weighted by its probability ("exact", classification only: equal to the Gauss-Newton matrix).
``"auto"`` (:func:`resolve_fisher`) picks ``"exact"`` for gradtrace's classification and regression losses with
at most :data:`EXACT_MAX_OUTPUTS` outputs, ``"true"`` for LMs and wider outputs and ``"empirical"`` for custom
losses: one sampled label per output is a noisy
estimate when an example has a single output (a sequence averages it over its tokens), and the exact
expectation costs one pass per class.

``"true"`` samples labels from the likelihood of the loss's outputs: gradtrace's own losses have theirs
(:data:`BUILTIN_LIKELIHOODS`); a custom loss names one with ``likelihood=`` (:mod:`gradtrace.loss.likelihoods`).

Each returns the per-example loss functions of the fitting passes; their gradients' second moments, summed
over passes, estimate the chosen Fisher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...loss.functions import (
    MODEL_KEYS,
    LossFn,
    causal_lm_loss,
    classification_loss,
    default_loss,
    lm_labels,
    regression_loss,
    token_log_probs,
)
from ...loss.likelihoods import Likelihood, categorical, gaussian

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


def _lm_logits(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    return model(**{k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}).logits


def _lm_targets_kept(batch: dict[str, Any]) -> Tensor:
    """``[B, T]``: the positions ``causal_lm_loss`` scores (a next token that is not ignored)."""
    labels = lm_labels(batch)
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1) != -100


def _split(batch: Any) -> tuple[Any, Tensor | None]:
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k not in ("labels", "id")}, batch.get("labels")
    return batch[0], batch[1]


def _logits(model: nn.Module, inputs: Any) -> Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return getattr(out, "logits", out)


def _outputs(model: nn.Module, batch: Any) -> Tensor:
    return _logits(model, _split(batch)[0])


BUILTIN_LIKELIHOODS = {  # the likelihoods behind gradtrace's own losses
    "lm": categorical(_lm_logits, mask=_lm_targets_kept),
    "cls": categorical(_outputs),
    "reg": gaussian(_outputs),  # unit variance: the output-gradient is -noise
}


def _weighted(loss_fn: LossFn, weight: float) -> LossFn:
    def loss(model: nn.Module, batch: Any) -> Tensor:
        return loss_fn(model, batch) * weight

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
        weight = token_log_probs(logits, target).mul_(0.5).exp_()  # sqrt p(label), no float32 copy of the logits
        return F.cross_entropy(logits, target, reduction="none") * weight

    return loss


def fisher_passes(loss_fn: LossFn | None, fisher: str, sample_batch: Any, *, samples: int = 1, seed: int = 0,
                  num_classes: int | None = None, likelihood: Likelihood | None = None) -> list[LossFn]:
    """The per-pass loss functions estimating the ``fisher`` of ``loss_fn`` (see module docstring);
    ``likelihood``: what ``fisher="true"`` samples for a custom loss (:mod:`gradtrace.loss.likelihoods`)."""
    if fisher not in FISHERS:
        raise ValueError(f"fisher must be one of {(*FISHERS, 'auto')}, got {fisher!r}")
    if likelihood is not None and not isinstance(likelihood, Likelihood):
        raise TypeError("likelihood= must be a gradtrace.loss.likelihoods.Likelihood (categorical(...) or "
                        f"gaussian(...)), got {type(likelihood).__name__}")
    fn = loss_fn or default_loss(sample_batch)
    if fisher == "empirical":
        if likelihood is not None:
            raise ValueError("likelihood= is what fisher='true' samples labels from; with fisher='empirical' (the "
                             "observed labels) it is unused: pass fisher='true' or drop likelihood=")
        return [fn]
    kind = _kind(fn)
    if kind == "custom" and likelihood is None:
        raise ValueError(f"fisher={fisher!r} needs labels sampled from the model: for a custom loss name the "
                         "likelihood of its outputs, likelihood=gradtrace.loss.likelihoods.categorical(logits_fn) (or "
                         "gaussian(outputs_fn)) with fisher='true', or use fisher='empirical'")
    if fisher == "exact":
        if likelihood is not None:
            raise ValueError("fisher='exact' enumerates the labels of gradtrace's own losses; with likelihood= use "
                             "fisher='true' (samples=... draws per output)")
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
    chosen = likelihood or BUILTIN_LIKELIHOODS[kind]
    return [_weighted(chosen.sampled_loss(generator), 1.0 / samples ** 0.5) for _ in range(samples)]


def resolve_fisher(fisher: str, loss_fn: LossFn | None, model: nn.Module, sample_batch: Any,
                   likelihood: Likelihood | None = None) -> tuple[str, int | None]:
    """The Fisher to fit (``"auto"`` resolved) and, when it is ``"exact"``, the number of outputs it enumerates
    (one no-grad forward pass on ``sample_batch``; None otherwise).

    ``"auto"`` is ``"exact"`` for :func:`~gradtrace.loss.classification_loss` / ``regression_loss`` with at most
    :data:`EXACT_MAX_OUTPUTS` outputs (one pass per output), ``"true"`` (sampled labels) for larger ones and
    for :func:`~gradtrace.loss.functions.causal_lm_loss`, ``"empirical"`` for a custom loss (gradtrace knows no
    likelihood to sample its labels from) unless ``likelihood=`` names one (then ``"true"``). The fitted
    curvature's ``fisher`` records the choice.
    """
    if fisher == "auto" and likelihood is not None:
        return "true", None
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
