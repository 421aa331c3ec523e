"""Tiny tasks for the replay tests: data, models, a loss, a real torch.optim loop and an unrolled reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradtrace.replay import RunRecorder


def make_data(n: int = 12, d: int = 4, classes: int = 3, dtype: torch.dtype = torch.float64,
              seed: int = 0) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """``{id: (x [d], y [])}`` for ``n`` random examples, ids ``0..n-1``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=gen)
    return {i: (x[i], y[i]) for i in range(n)}


class MLP(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(kind: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MLP() if kind == "mlp" else nn.Linear(4, 3)
    return model.to(dtype)


def batcher(data: dict) -> Callable[[list], dict]:
    def batches(ids: list) -> dict:
        return {"x": torch.stack([data[i][0] for i in ids]), "y": torch.stack([data[i][1] for i in ids])}
    return batches


def loss_fn(forward: Callable, batch: dict) -> torch.Tensor:
    """Per-example cross-entropy ``[B]``."""
    return F.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")


def schedule(n: int = 12, batch: int = 4, epochs: int = 3, accumulation: int = 1, seed: int = 1) -> list:
    """Per optimizer step, the ids of each micro-batch: ``epochs`` shuffled passes (examples repeat)."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for s in range(0, n, batch):
            ids = order[s:s + batch]
            size = len(ids) // accumulation
            steps.append([ids[m * size:(m + 1) * size] for m in range(accumulation)])
    return steps


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """transformers' ``get_cosine_schedule_with_warmup`` lambda (half a cosine)."""
    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return f


OPTIMIZERS = {
    "sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.3, momentum=0.9, dampening=0.1, weight_decay=0.01,
                                                **kw),
    "nesterov": lambda params, **kw: torch.optim.SGD(params, lr=0.2, momentum=0.8, nesterov=True,
                                                     weight_decay=0.02, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=0.05, betas=(0.9, 0.99), eps=1e-6,
                                                    weight_decay=0.1, **kw),
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=0.05, weight_decay=0.01, **kw),
}


def train(model: nn.Module, optimizer: str, steps: list, data: dict, *, accumulation: int = 1,
          grad_clip: float | None = None, warmup: int | None = None, weights: dict | None = None,
          record: Path | None = None, foreach: bool | None = False, keep_states: int | None = None) -> nn.Module:
    """The real loop: torch.optim, ``loss = sum w_i l_i / B / accumulation``, ``clip_grad_norm_``, a scheduler."""
    opt = OPTIMIZERS[optimizer](model.parameters(), foreach=foreach)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, len(steps)))
             if warmup is not None else None)
    rec = RunRecorder(record, model, opt, scheduler=sched, grad_clip=grad_clip,
                      accumulation=accumulation, keep_states=keep_states) if record is not None else None
    batches = batcher(data)
    for micro in steps:
        for ids in micro:
            losses = loss_fn(model, batches(ids))
            if weights is None:
                loss = losses.mean()
            else:
                w = torch.stack([weights.get(i, torch.ones((), dtype=losses.dtype)) for i in ids])
                loss = (w * losses).sum() / len(ids)
            (loss / accumulation if accumulation > 1 else loss).backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=foreach)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        if rec is not None:
            rec.step(micro)
    if rec is not None:
        rec.finish(model)
    return model
