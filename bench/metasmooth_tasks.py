"""Metasmooth recipe variants of the bundled tasks (issue #32), for ``bench/metagrad_quality.py``.

The variants were declared (2026-12-03, before any of their results) as follows; see the bench docstring:

* ``digits_mlp_smooth``: digits_mlp's data (1000 training images, 100 queries, pixels ``"unit"``, split seed 0),
  MLP 64-64-64-10 with exact (erf) GELU, SGD momentum 0.9 (no nesterov), coupled weight decay 1e-4, batches of 100,
  30 epochs, lr 0.05 with linear warmup over the first 10% of steps then cosine decay to 0, float32;
* ``digits_mlp_fullbatch``: the same GELU MLP, full-batch gradient descent (the whole (sub)set, mean loss, every
  step), SGD momentum 0.9, coupled weight decay 1e-4, constant lr 0.1, 300 steps, float32;
* ``digits_softmax``: linear softmax regression 64 -> 10 (one ``nn.Linear``), full batch, SGD momentum 0.9,
  constant lr 0.5, coupled weight decay 1e-3, 300 steps, float32 (a convex control);
* ``tinylm_smooth``: tinylm with eager attention throughout, batches of 50 documents, 20 epochs, AdamW lr 1e-3
  with linear warmup over the first 10% of steps then cosine decay to 0, weight decay 0.

Each variant's :meth:`train` runs its :class:`Recipe` with :func:`run_recipe`, the loop the bench's ``record()``
re-runs beside a ``RunRecorder``, so the attributed model, the retraining ground truth and the recorded run are one
recipe. The warmup-cosine factor of optimizer step ``t`` (0-based) of a run of ``T`` steps with ``W =
round(warmup * T)`` warmup steps is ``t / W`` for ``t < W``, then ``(1 + cos(pi (t - W) / (T - W))) / 2``
(Hugging Face's ``get_cosine_schedule_with_warmup``), a ``LambdaLR`` stepped after each optimizer step; ``T``
counts the steps of the run at hand (a half-size subset has half the mini-batch steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtrace.eval.tasks.base import fresh_model
from gradtrace.eval.tasks.digits import DigitsTask
from gradtrace.eval.tasks.digits_mlp import DigitsReLUMLP
from gradtrace.eval.tasks.tinylm import TinyLMConfig, TinyLMTask
from gradtrace.loss import causal_lm_loss

__all__ = ["VARIANTS", "Recipe", "run_recipe", "warmup_cosine"]

StepHook = Callable[[Tensor], None]  # called after each optimizer step with the step's training rows [B]


@dataclass(frozen=True)
class Recipe:
    """A training recipe: what ``Task.train`` runs and the bench's ``record()`` re-runs, recorded."""

    new_model: Callable[[], nn.Module]  # the model, built under the training seed
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch_loss: Callable[[nn.Module, Tensor], Tensor]  # (model, training rows [B]) -> the scalar loss of the step
    batch_size: int | None  # examples per step; None: full batch (the whole subset, in index order, every step)
    epochs: int  # passes over the subset (full batch: steps)
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None  # (optimizer, total steps) -> scheduler


def warmup_cosine(warmup: float) -> Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LambdaLR]:
    """The linear-warmup-then-cosine-to-0 ``LambdaLR`` over a run's ``total`` steps (see the module docstring)."""

    def build(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
        warm = round(warmup * total)

        def factor(step: int) -> float:
            if step < warm:
                return step / warm
            return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return build


@torch.enable_grad()
def run_recipe(recipe: Recipe, indices: Tensor, seed: int,
               on_start: Callable[[nn.Module, torch.optim.Optimizer, Any], StepHook] | None = None) -> nn.Module:
    """Train ``recipe`` on the training rows ``indices`` with seed ``seed`` (``minibatch_epochs``'s loop: one
    shuffle of the subset per epoch from a generator seeded by ``seed``; full batch: the rows in order, unshuffled).
    ``on_start(model, optimizer, scheduler)`` runs before the first step and returns a hook called after every
    step with its rows (the bench's recorder). Returns the model in eval mode."""
    indices, model = fresh_model(indices, seed, recipe.new_model)
    optimizer = recipe.optimizer(model.parameters())
    size = indices.numel() if recipe.batch_size is None else recipe.batch_size
    total = recipe.epochs * math.ceil(indices.numel() / size)
    scheduler = recipe.scheduler(optimizer, total) if recipe.scheduler is not None else None
    on_step = on_start(model, optimizer, scheduler) if on_start is not None else None
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(recipe.epochs):
        order = indices if recipe.batch_size is None else indices[torch.randperm(indices.numel(), generator=generator)]
        for start in range(0, order.numel(), size):
            rows = order[start:start + size]
            loss = recipe.batch_loss(model, rows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if on_step is not None:
                on_step(rows)
    return model.eval()


# -- digits family ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DigitsVariantConfig:
    """Settings of a digits variant (digits_mlp's data; the recipe of the declaration)."""

    num_train: int = 1000  # training images (digits_mlp's)
    num_queries: int = 100  # held-out query images (digits_mlp's)
    model: str = "gelu_mlp"  # "gelu_mlp": 64 -> width (GELU, erf) x depth -> 10; "softmax": one Linear 64 -> 10
    width: int = 64
    depth: int = 2
    batch_size: int | None = 100  # images per SGD step; None: full batch
    epochs: int = 30  # passes over the subset (full batch: steps)
    lr: float = 0.05  # peak SGD learning rate
    schedule: str = "warmup_cosine"  # "warmup_cosine" or "constant"
    warmup: float = 0.1  # fraction of the run's steps warmed up linearly (warmup_cosine)
    momentum: float = 0.9  # SGD momentum (no nesterov, no dampening)
    weight_decay: float = 1e-4  # SGD's coupled weight decay (the gradient of (wd / 2) |theta|^2)
    pixels: str = "unit"
    split_seed: int = 0
    seed: int = 0


class DigitsGELUMLP(DigitsReLUMLP):
    """``64 -> width (GELU) -> ... -> 10``, exact GELU (``F.gelu``, erf); ``forward(inputs [B, 64]) -> [B, 10]``."""

    def forward(self, inputs: Tensor) -> Tensor:
        acts = inputs
        for layer in self.hidden:
            acts = F.gelu(layer(acts))
        return self.out(acts)


class DigitsSoftmax(nn.Module):
    """Linear softmax regression, one ``nn.Linear(64, 10)``; ``forward(inputs [B, 64]) -> logits [B, 10]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.linear(inputs)


class DigitsVariant(DigitsTask):
    """A digits variant: digits_mlp's images and split, the declared SGD recipe (``declared`` overrides)."""

    settings_class = DigitsVariantConfig
    declared: ClassVar[dict[str, Any]] = {}

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**{**self.declared, **overrides})

    def recipe(self) -> Recipe:
        cfg = self.settings

        def new_model() -> nn.Module:
            return DigitsSoftmax() if cfg.model == "softmax" else DigitsGELUMLP(cfg.width, cfg.depth)

        def batch_loss(model: nn.Module, rows: Tensor) -> Tensor:
            return F.cross_entropy(model(self.x_train[rows]), self.y_train[rows])

        return Recipe(new_model, lambda params: torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                                                                weight_decay=cfg.weight_decay),
                      batch_loss, cfg.batch_size, cfg.epochs,
                      warmup_cosine(cfg.warmup) if cfg.schedule == "warmup_cosine" else None)

    def train(self, indices: Tensor, seed: int) -> nn.Module:
        return run_recipe(self.recipe(), indices, seed)

    def describe(self) -> str:
        cfg = self.settings
        dims = "-".join(["64"] + [str(cfg.width)] * cfg.depth + ["10"])
        model = "softmax regression 64-10" if cfg.model == "softmax" else f"MLP {dims} (GELU)"
        batches = ("full batch, " + f"{cfg.epochs} steps" if cfg.batch_size is None
                   else f"{cfg.epochs} epochs of batches of {cfg.batch_size}")
        schedule = f"warmup {cfg.warmup} + cosine" if cfg.schedule == "warmup_cosine" else "constant"
        return (f"{self.name}: {model} on {self.num_train} sklearn 8x8 digit images, {self.num_queries} held-out "
                f"queries; SGD momentum {cfg.momentum}, lr {cfg.lr} ({schedule}), {batches}, coupled weight decay "
                f"{cfg.weight_decay}, pixels {cfg.pixels}")


class DigitsMLPSmooth(DigitsVariant):
    name = "digits_mlp_smooth"
    declared: ClassVar[dict[str, Any]] = {}  # the config's defaults are this variant


class DigitsMLPFullBatch(DigitsVariant):
    name = "digits_mlp_fullbatch"
    declared: ClassVar[dict[str, Any]] = {"batch_size": None, "epochs": 300, "lr": 0.1, "schedule": "constant"}


class DigitsSoftmaxTask(DigitsVariant):
    name = "digits_softmax"
    declared: ClassVar[dict[str, Any]] = {"model": "softmax", "batch_size": None, "epochs": 300, "lr": 0.5,
                                          "schedule": "constant", "weight_decay": 1e-3}


# -- tinylm family ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TinyLMSmoothConfig(TinyLMConfig):
    """tinylm's settings with the declared recipe: batches of 50, AdamW lr 1e-3, warmup 10% + cosine to 0."""

    batch_size: int = 50
    lr: float = 1e-3
    schedule: str = "warmup_cosine"
    warmup: float = 0.1
    attention: str = "eager"  # eager attention throughout (training, ground truth, replay)


class TinyLMSmooth(TinyLMTask):
    """tinylm with eager attention and the declared AdamW warmup-cosine recipe (``tinylm_smooth``)."""

    name = "tinylm_smooth"

    def __init__(self, **overrides: Any) -> None:
        super().__init__(TinyLMSmoothConfig(), **overrides)

    def new_model(self, attn_implementation: str | None = None) -> nn.Module:
        return super().new_model(attn_implementation="eager")

    def recipe(self) -> Recipe:
        cfg = self.settings

        def batch_loss(model: nn.Module, rows: Tensor) -> Tensor:
            mask = self.train_mask[rows]
            used = int(mask.sum(1).max())
            return causal_lm_loss(model, {"input_ids": self.train_tokens[rows, :used],
                                          "attention_mask": mask[:, :used]}).mean()

        return Recipe(self.new_model, lambda params: torch.optim.AdamW(params, lr=cfg.lr,
                                                                       weight_decay=cfg.weight_decay),
                      batch_loss, cfg.batch_size, cfg.epochs, warmup_cosine(cfg.warmup))

    def train(self, indices: Tensor, seed: int) -> nn.Module:
        return run_recipe(self.recipe(), indices, seed)

    def describe(self) -> str:
        return super().describe().replace("tinylm:", "tinylm_smooth:", 1) + (
            f", warmup {self.settings.warmup} + cosine to 0, eager attention")


VARIANTS: dict[str, type] = {cls.name: cls for cls in (DigitsMLPSmooth, DigitsMLPFullBatch, DigitsSoftmaxTask,
                                                       TinyLMSmooth)}
"""The variant tasks by name (``--tasks`` values of ``bench/metagrad_quality.py``)."""
