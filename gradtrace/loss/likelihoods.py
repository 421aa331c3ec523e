"""Likelihoods of a model's outputs: what the true Fisher (``fisher="true"``: labels sampled from the model) samples.

gradtrace knows the likelihood behind its own losses (categorical for ``classification_loss`` and
``causal_lm_loss``, a unit Gaussian for ``regression_loss``). A custom ``loss_fn`` names its own::

    likelihood = gradtrace.loss.likelihoods.categorical(lambda model, batch: my_forward(model, batch).logits,
                                                   mask=lambda batch: batch["loss_mask"][:, 1:])
    attr.fit(model, data, my_loss, likelihood=likelihood)            # kfac / ekfac / ggn with fisher="true"

``outputs(model, batch)`` returns the tensor the likelihood is over: ``[B, ..., C]`` logits (categorical) or
``[B, ...]`` predicted means (Gaussian), with gradients. ``mask(batch)`` (categorical, optional) is ``[B, ...]``,
True where an output counts (not padding, not an ignored position); the sampled labels of the other positions are
ignored. Each fitting pass draws one label per output with ``generator`` and returns the per-example loss
``-log p(sampled label | outputs)`` summed over the example's outputs, whose gradients' second moments are the true
Fisher.

Categorical labels are drawn on the logits' device, a block of rows at a time (:func:`sample_labels`): no float32
``[N, V]`` copy of the logits exists, on the device or the host. On the CPU the labels are exactly those of one
``torch.multinomial`` call on the whole softmax, for any block size; on another device they come from a generator
of that device seeded from ``generator``, so a seed gives the same labels on the same kind of device (and, being a
different random stream, other labels than on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .functions import LossFn, row_chunk, token_cross_entropy

__all__ = ["Likelihood", "categorical", "gaussian", "sample_labels"]

Outputs = Callable[[nn.Module, Any], Tensor]
Mask = Callable[[Any], Tensor]


@dataclass(frozen=True)
class Likelihood:
    """A distribution over a model's outputs (see the module docstring): ``kind`` ``"categorical"`` (over the last
    dimension of ``outputs``) or ``"gaussian"`` (``N(outputs, variance I)``)."""

    outputs: Outputs
    kind: str = "categorical"
    mask: Mask | None = None
    variance: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("categorical", "gaussian"):
            raise ValueError(f"likelihood kind must be 'categorical' or 'gaussian', got {self.kind!r}")
        if not self.variance > 0:
            raise ValueError(f"the Gaussian likelihood's variance must be > 0, got {self.variance!r}")
        if not callable(self.outputs):
            raise TypeError("likelihood outputs must be a function (model, batch) -> Tensor")

    def sampled_loss(self, generator: torch.Generator) -> LossFn:
        """The per-example loss of labels sampled from the model with ``generator`` (one fitting pass)."""
        sample = self._categorical if self.kind == "categorical" else self._gaussian

        def loss(model: nn.Module, batch: Any) -> Tensor:
            return sample(self.outputs(model, batch), batch, generator)

        return loss

    def _categorical(self, logits: Tensor, batch: Any, generator: torch.Generator) -> Tensor:
        """``[B]``: cross-entropy of labels drawn from ``softmax(logits)``, summed over each example's outputs."""
        flat = logits.reshape(-1, logits.shape[-1])
        sampled = sample_labels(flat, generator)
        if self.mask is not None:
            keep = self.mask(batch).to(logits.device).reshape(-1)
            if keep.numel() != sampled.numel():
                raise ValueError(f"the likelihood's mask has {keep.numel()} entries, its logits {sampled.numel()} "
                                 f"outputs (shape {tuple(logits.shape)}): the mask must be shaped like the logits "
                                 "without their last dimension")
            sampled = torch.where(keep.bool(), sampled, torch.full_like(sampled, -100))
        per_output = token_cross_entropy(flat, sampled)
        return per_output.view(logits.shape[0], -1).sum(1)

    def _gaussian(self, means: Tensor, batch: Any, generator: torch.Generator) -> Tensor:
        """``[B]``: ``|f - y|^2 / (2 variance)`` for ``y ~ N(f, variance I)``."""
        noise = torch.randn(means.shape, generator=generator).to(means.device, means.dtype)
        target = means.detach() + noise * self.variance ** 0.5
        return 0.5 * (means - target).reshape(means.shape[0], -1).pow(2).sum(1) / self.variance


def sample_labels(logits: Tensor, generator: torch.Generator, chunk: int | None = None) -> Tensor:
    """``[N]`` labels drawn from ``softmax`` of ``[N, V]`` logits, on the logits' device, ``chunk`` rows at a time.

    Each block of rows is one ``torch.multinomial`` call on the float32 softmax of that block: the most memory held
    is a few ``[chunk, V]`` float32 blocks (default: about 2M entries, :func:`~.functions.row_chunk`), not ``[N, V]``.
    ``torch.multinomial`` draws a single label by the exponential race (``argmax_v p_v / E_v`` with ``E ~ Exp(1)``,
    an exact draw from ``p``) and takes its ``E`` from the generator row after row, so the blocks consume the stream
    as one call on all rows would: on the CPU the labels do not depend on ``chunk`` and are those of
    ``torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)``. Logits on another device
    than ``generator`` draw from a generator of their device seeded by one draw from ``generator`` (reproducible
    from the seed on that kind of device; no host copy).
    """
    rows, width = logits.shape
    chunk = chunk or row_chunk(width)
    draw = generator
    if generator.device != logits.device:
        seed = int(torch.randint(0, 2 ** 62, (), generator=generator, device=generator.device))
        draw = torch.Generator(device=logits.device).manual_seed(seed)
    sampled = torch.empty(rows, dtype=torch.long, device=logits.device)
    with torch.no_grad():
        for start in range(0, rows, chunk):
            probs = torch.softmax(logits[start:start + chunk].float(), dim=-1)  # [chunk, V]
            sampled[start:start + chunk] = torch.multinomial(probs, 1, generator=draw).view(-1)
    return sampled


def categorical(outputs: Outputs, mask: Mask | None = None) -> Likelihood:
    """Labels drawn from ``softmax`` over the last dimension of ``outputs(model, batch)`` (``[B, ..., C]`` logits);
    ``mask(batch)`` (``[B, ...]``): where an output counts (default: everywhere)."""
    return Likelihood(outputs, "categorical", mask)


def gaussian(outputs: Outputs, variance: float = 1.0) -> Likelihood:
    """Targets drawn from ``N(outputs(model, batch), variance I)`` (a squared-error loss's likelihood)."""
    return Likelihood(outputs, "gaussian", variance=variance)
