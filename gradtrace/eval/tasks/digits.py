"""``digits``: an MLP classifying scikit-learn's 8x8 handwritten digits (1,797 images, no download).

The images are shuffled once (``split_seed``); the first ``num_train`` are the training set, the next
``num_queries`` the queries and the rest the test set for :meth:`DigitsTask.accuracy`. Pixels (0..16) are
scaled as ``settings.pixels`` says: ``"standardize"`` (this task's default) gives every pixel the training
set's zero mean and unit standard deviation; ``"unit"`` divides by 16, to ``[0, 1]`` (what torchvision's
``ToTensor`` does to 8-bit images); ``"global"`` is ``"unit"`` followed by one mean and standard deviation over
all the training set's pixels (MNIST's usual ``Normalize((0.1307,), (0.3081,))``). The model is ``64 -> hidden (tanh) ->
10``, trained full-batch with Adam for a fixed number of steps on the mean cross-entropy plus the L2
penalty ``(weight_decay / 2) |theta|^2``; the seed sets the initialisation, and there is no other
randomness, so a training run is a deterministic function of (subset, seed). The attributed loss (and
the query outcome) is the per-example cross-entropy, without the penalty.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...loss.functions import classification_loss
from .base import Task, fresh_model, tensor_digest

__all__ = ["DigitsConfig", "DigitsMLP", "DigitsTask"]


@dataclass(frozen=True)
class DigitsConfig:
    """Settings of the digits task."""

    num_train: int = 1000  # training images (the first of a fixed shuffle)
    num_queries: int = 100  # query images, held out (the next ones)
    hidden: int = 32  # width of the tanh hidden layer
    steps: int = 300  # full-batch Adam steps
    lr: float = 0.02  # Adam learning rate
    weight_decay: float = 1e-3  # L2 penalty (weight_decay / 2) |theta|^2 added to the mean training loss
    pixels: str = "standardize"  # pixel scaling: "standardize" (per pixel), "unit" ([0, 1]) or "global"
    split_seed: int = 0  # the shuffle that splits train / queries / test
    seed: int = 0  # training seed of the model trained on all the training images


PIXEL_SCALINGS = ("standardize", "unit", "global")


def scale_pixels(images: Tensor, train: Tensor, how: str) -> Tensor:
    """``images [n, 64]`` (values 0..16) scaled as ``how`` says (see the module docstring), with statistics
    from the rows ``train`` only."""
    if how == "standardize":
        mean, std = images[train].mean(0), images[train].std(0)
        std = torch.where(std > 0, std, torch.ones_like(std))  # pixels that are always blank
        return (images - mean) / std
    if how == "unit":
        return images / 16
    if how == "global":
        unit = images / 16
        return (unit - unit[train].mean()) / unit[train].std()
    raise ValueError(f"unknown pixel scaling {how!r}; choose one of {', '.join(PIXEL_SCALINGS)}")


class DigitsMLP(nn.Module):
    """``64 -> hidden (tanh) -> 10``; ``forward(inputs [B, 64]) -> logits [B, 10]``."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.out = nn.Linear(hidden, 10)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(inputs)))


class DigitsTask(Task):
    """The digits task (see the module docstring); ``DigitsTask(num_train=300, ...)`` overrides settings."""

    name = "digits"
    version = 1
    settings_class: ClassVar[type] = DigitsConfig  # the default settings (a subclass with another recipe swaps it)

    def __init__(self, settings: Any = None, **overrides: Any) -> None:
        super().__init__(replace(settings or self.settings_class(), **overrides))
        from sklearn.datasets import load_digits

        cfg = self.settings
        data = load_digits()
        images = torch.tensor(data.data, dtype=torch.float32)  # [1797, 64], values 0..16
        labels = torch.tensor(data.target, dtype=torch.long)
        if cfg.num_train + cfg.num_queries >= len(images):
            raise ValueError(f"{cfg.num_train} + {cfg.num_queries} examples asked of {len(images)} images, "
                             "leaving no test set")
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(cfg.split_seed))
        train, queries = order[:cfg.num_train], order[cfg.num_train:cfg.num_train + cfg.num_queries]
        test = order[cfg.num_train + cfg.num_queries:]
        images = scale_pixels(images, train, cfg.pixels)
        self.x_train, self.y_train = images[train], labels[train]  # [N, 64], [N]
        self.x_query, self.y_query = images[queries], labels[queries]  # [Q, 64], [Q]
        self.x_test, self.y_test = images[test], labels[test]
        self._train_ids = [f"digit-{int(i):04d}" for i in train]
        self._query_ids = [f"digit-{int(i):04d}" for i in queries]

    @property
    def train_ids(self) -> list[str]:
        return self._train_ids

    @property
    def query_ids(self) -> list[str]:
        return self._query_ids

    def train_batches(self, batch_size: int | None = None) -> list[dict[str, Any]]:
        size = batch_size or self.num_train
        return [{"inputs": self.x_train[s:s + size], "labels": self.y_train[s:s + size],
                 "id": self._train_ids[s:s + size]} for s in range(0, self.num_train, size)]

    def query_batches(self) -> list[dict[str, Any]]:
        return [{"inputs": self.x_query, "labels": self.y_query, "id": list(self._query_ids)}]

    def data_digest(self) -> str:
        return tensor_digest(self.x_train, self.y_train, self.x_query, self.y_query)

    @property
    def loss_fn(self):
        return classification_loss

    @torch.enable_grad()
    def train(self, indices: Tensor, seed: int) -> DigitsMLP:
        cfg = self.settings
        indices, model = fresh_model(indices, seed, lambda: DigitsMLP(cfg.hidden))
        inputs, labels = self.x_train[indices], self.y_train[indices]
        params = list(model.parameters())
        optimizer = torch.optim.Adam(params, lr=cfg.lr)
        model.train()
        for _ in range(cfg.steps):
            penalty = sum(p.pow(2).sum() for p in params)
            loss = F.cross_entropy(model(inputs), labels) + 0.5 * cfg.weight_decay * penalty
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return model.eval()

    @torch.no_grad()
    def accuracy(self, model: nn.Module | None = None) -> float:
        """Accuracy on the held-out test images (neither training nor query images)."""
        model = model if model is not None else self.model
        return float((model(self.x_test).argmax(1) == self.y_test).float().mean())

    def describe(self) -> str:
        cfg = self.settings
        return (f"digits: MLP 64-{cfg.hidden}(tanh)-10 on {self.num_train} sklearn 8x8 digit images, "
                f"{self.num_queries} held-out queries; full-batch Adam, {cfg.steps} steps, lr {cfg.lr}, "
                f"L2 {cfg.weight_decay}, pixels {cfg.pixels}")
