"""``digits_mlp``: a two-hidden-layer ReLU MLP trained to near convergence on scikit-learn's digits.

The literature-style companion of ``digits`` (the setups of MLP-on-MNIST LDS benchmarks): the same images and
split (:class:`~gradtrace.eval.tasks.digits.DigitsTask`), but pixels scaled to ``[0, 1]`` as image pipelines
do (``pixels="unit"``, torchvision's ``ToTensor``; ``digits`` standardises every pixel, which acts as a diagonal
preconditioner of the first layer and flatters plain gradient similarity), a deeper, wider model,
``64 -> width (ReLU) -> width (ReLU) -> 10``, trained with mini-batch Adam for enough epochs that the training loss
is close to zero, and only a small L2 penalty ``(weight_decay / 2) |theta|^2`` on the mean cross-entropy of
each batch (its gradient added by Adam's coupled ``weight_decay``). The seed sets the initialisation and the
order of the mini-batches (one permutation of the subset per epoch), so a training run is a deterministic
function of (subset, seed). The attributed loss (and the query outcome) is the per-example cross-entropy,
without the penalty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import fresh_model, minibatch_epochs
from .digits import DigitsTask

__all__ = ["DigitsMLPConfig", "DigitsMLPTask", "DigitsReLUMLP"]


@dataclass(frozen=True)
class DigitsMLPConfig:
    """Settings of the digits_mlp task."""

    num_train: int = 1000  # training images (the first of the same fixed shuffle as ``digits``)
    num_queries: int = 100  # query images, held out (the next ones)
    width: int = 64  # width of each ReLU hidden layer
    depth: int = 2  # number of hidden layers
    epochs: int = 100  # passes over the training subset
    batch_size: int = 32  # images per Adam step
    lr: float = 1e-3  # Adam learning rate
    weight_decay: float = 1e-4  # L2 penalty (weight_decay / 2) |theta|^2 added to each batch's mean loss
    pixels: str = "unit"  # pixel scaling: "unit" ([0, 1]), "global" or "standardize" (per pixel), see digits
    split_seed: int = 0  # the shuffle that splits train / queries / test
    seed: int = 0  # training seed of the model trained on all the training images


class DigitsReLUMLP(nn.Module):
    """``64 -> width (ReLU) -> ... -> 10`` with ``depth`` hidden layers; ``forward(inputs [B, 64]) -> [B, 10]``."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        dims = [64] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(d_in, d_out) for d_in, d_out in pairwise(dims))
        self.out = nn.Linear(width, 10)

    def forward(self, inputs: Tensor) -> Tensor:
        acts = inputs
        for layer in self.hidden:
            acts = torch.relu(layer(acts))
        return self.out(acts)


class DigitsMLPTask(DigitsTask):
    """The digits_mlp task (see the module docstring); ``DigitsMLPTask(epochs=50, ...)`` overrides settings."""

    name = "digits_mlp"
    version = 1
    settings_class = DigitsMLPConfig

    @torch.enable_grad()
    def train(self, indices: Tensor, seed: int,
              on_epoch: Callable[[int, nn.Module], None] | None = None) -> DigitsReLUMLP:
        """See :meth:`Task.train`; ``on_epoch(epoch, model)`` is called after each epoch (1-based), e.g. to save
        checkpoints (:meth:`Task.checkpoints`)."""
        cfg = self.settings
        indices, model = fresh_model(indices, seed, lambda: DigitsReLUMLP(cfg.width, cfg.depth))
        # Adam's (coupled) weight_decay adds weight_decay * theta to the gradient: the L2 penalty's gradient.
        # fused: one kernel per step (same update; 1.6x faster training of this small model on CPU)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        return minibatch_epochs(model, indices, seed, optimizer, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                batch_loss=lambda rows: F.cross_entropy(model(self.x_train[rows]), self.y_train[rows]),
                                on_epoch=on_epoch)

    @torch.no_grad()
    def train_loss(self, model: nn.Module | None = None) -> float:
        """Mean cross-entropy over all the training images (how close to convergence the model is)."""
        model = model if model is not None else self.model
        return float(F.cross_entropy(model(self.x_train), self.y_train))

    def describe(self) -> str:
        cfg = self.settings
        dims = "-".join(["64"] + [str(cfg.width)] * cfg.depth + ["10"])
        return (f"digits_mlp: MLP {dims} (ReLU) on {self.num_train} sklearn 8x8 digit images, {self.num_queries} "
                f"held-out queries; Adam lr {cfg.lr}, {cfg.epochs} epochs of batches of {cfg.batch_size}, "
                f"L2 {cfg.weight_decay}, pixels {cfg.pixels}")
