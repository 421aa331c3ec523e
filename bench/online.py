"""Step-time overhead of the training-time callbacks: online data selection and SAMA reweighting.

Two workloads (random data, no downloads):

* ``mlp`` -- a 64-256-256-10 MLP, batch 64 (the size of the digits demonstration, a little wider)
* ``lm``  -- a random-init GPT-2 (default: 2 layers, width 128, a 2,048-token vocabulary, 64 tokens, batch 16)

and five modes, each with its own copy of the model and its own Adam optimizer:

* ``plain``          -- forward, backward, ``optimizer.step()``
* ``select-batch``   -- ``OnlineSelection`` (its default target, the batch mean) under ``gradtrace.capture``
  (exact per-example gradients, scores against the batch mean, the dropped examples' contributions subtracted
  from ``param.grad``)
* ``select-val``     -- ``OnlineSelection(validation=...)``: adds a forward and backward pass of one
  validation batch (same size as a training batch) through the capture hooks each step
* ``sama``           -- ``SAMAReweighting``: a meta-gradient on a validation batch, the Adam update Jacobian, and
  two extra forward passes of the training batch (central finite differences) each step

The modes take turns step by step in one process (so machine drift hits all alike); the median time per
optimizer step after warm-up is reported with its ratio to ``plain``.

    python bench/online.py
    python bench/online.py --workloads lm --layers 4 --width 256 --steps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.options import Loss
from gradtrace.options.train import ReweightingOptions, SelectionOptions
from gradtrace.train import OnlineSelection, SAMAReweighting

MODES = ("plain", "select-batch", "select-val", "sama")


def _mlp_workload(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Callable, list[dict], list[dict]]:
    gen = torch.Generator().manual_seed(0)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    def batch(i: int) -> dict:
        return {"x": torch.randn(64, 64, generator=gen), "y": torch.randint(0, 10, (64,), generator=gen),
                "id": [f"b{i}-{j}" for j in range(64)]}

    return make, loss_fn, [batch(i) for i in range(8)], [batch(100 + i) for i in range(2)]


def _lm_workload(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Callable, list[dict], list[dict]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from gradtrace.loss.functions import causal_lm_loss

    hf_logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=max(1, args.width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        return causal_lm_loss(model, batch, mean=True)

    def batch(i: int) -> dict:
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "id": [f"b{i}-{j}" for j in range(args.batch)]}

    return make, loss_fn, [batch(i) for i in range(8)], [batch(100 + i) for i in range(2)]


class _Runner:
    """One mode: its model, optimizer and callback; ``step(batch)`` runs one optimizer step."""

    def __init__(self, mode: str, make: Callable, loss_fn: Callable, validation: list[dict]) -> None:
        self.mode = mode
        self.loss_fn = loss_fn
        self.model = make()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.cap = self.sama = None
        if mode.startswith("select"):
            options = SelectionOptions(rule="bottom", fraction=0.25)
            if mode == "select-batch":
                selector = OnlineSelection(self.optimizer, options=options)
            else:
                selector = OnlineSelection(self.optimizer, validation=validation, loss_fn=loss_fn, options=options)
            self.cap = gradtrace.capture(self.model, loss=Loss(reduction="mean"), callbacks=[selector])
            self.cap.__enter__()
        elif mode == "sama":
            self.sama = SAMAReweighting(self.model, self.optimizer, validation, loss_fn=loss_fn,
                                        options=ReweightingOptions(normalize=True))

    def step(self, batch: dict) -> float:
        start = time.perf_counter()
        if self.sama is not None:
            loss = self.sama.loss(batch)
        else:
            if self.cap is not None:
                self.cap.annotate(ids=batch["id"])
            loss = self.loss_fn(self.model, {k: v for k, v in batch.items() if k != "id"}).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.cap is not None:
            self.cap.__exit__(None, None, None)
        if self.sama is not None:
            self.sama.close()


def run(workload: str, args: argparse.Namespace) -> dict[str, float]:
    make, loss_fn, train, validation = (_mlp_workload if workload == "mlp" else _lm_workload)(args)
    runners = [_Runner(mode, make, loss_fn, validation) for mode in args.modes]
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    try:
        for i in range(args.warmup + args.steps):
            for runner in runners:
                seconds = runner.step(train[i % len(train)])
                if i >= args.warmup:
                    times[runner.mode].append(seconds)
    finally:
        for runner in runners:
            runner.close()
    return {mode: statistics.median(values) for mode, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "lm"], choices=["mlp", "lm"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")
    torch.set_num_threads(args.threads)
    print(f"# host: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__} ({args.threads} threads), "
          f"python {platform.python_version()}; median of {args.steps} steps after {args.warmup} warm-up steps, "
          "modes taking turns")
    for workload in args.workloads:
        if workload == "mlp":
            print("\nmlp: 64-256-256-10 MLP, batch 64, Adam")
        else:
            print(f"\nlm: GPT-2 {args.layers} layers, width {args.width}, vocab {args.vocab}, {args.seq} tokens x "
                  f"batch {args.batch}, Adam")
        medians = run(workload, args)
        print(f"{'mode':<14}{'ms/step':>9}{'ratio':>7}")
        for mode, seconds in medians.items():
            print(f"{mode:<14}{seconds * 1e3:>9.1f}{seconds / medians['plain']:>7.2f}")


if __name__ == "__main__":
    main()
