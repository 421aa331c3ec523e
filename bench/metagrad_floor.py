"""The floor of an exact reverse pass: one reverse step's core against one training step (issue #32, cost target).

Setup (fixed before any result): the MLP of ``bench/metagrad_cost.py`` (64 inputs, one tanh hidden layer of
``--hidden``, 10 classes), a batch of 32 random examples with per-example weights, fp32 on the CPU, ``--threads``
threads. Timed, each the least of ``--rounds`` rounds of 50 calls after 3 warm-up calls:

* ``train``: one training step's gradient (forward + backward of the weighted mean cross-entropy);
* ``double backward``: what every reverse step of ``gradtrace.replay.metagradients`` must compute at least -- the
  gradient built with ``create_graph=True`` and the gradient of ``<lambda, g>`` with respect to the parameters and
  the example weights (a Hessian-vector product and the weights' derivatives), as ``torch.autograd`` gives it;
* ``forward over reverse``: the same two quantities by ``torch.func.jvp`` of ``torch.func.grad`` (the alternative
  formulation), checked equal to the double backward first.

The ratio ``double backward / train`` bounds what any exact reverse pass costs per step beyond the replay that
precedes it. Usage::

    python bench/metagrad_floor.py [--hidden 256] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 10))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y, w = torch.randn(32, 64), torch.randint(0, 10, (32,)), torch.ones(32)
    lam = {k: torch.randn_like(v) for k, v in params.items()}

    def loss(p: dict, weights: torch.Tensor) -> torch.Tensor:
        return (weights * F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none")).mean()

    def train() -> None:
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        torch.autograd.grad(loss(p, w), list(p.values()))

    def double_backward() -> tuple:
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        weights = w.clone().requires_grad_(True)
        g = torch.autograd.grad(loss(p, weights), list(p.values()), create_graph=True)
        dot = sum((gi * lam[k]).sum() for gi, k in zip(g, p))
        return torch.autograd.grad(dot, [*p.values(), weights])

    def forward_over_reverse() -> tuple:
        def both(p: dict) -> tuple:
            per_example = F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none") / len(y)
            return grad(lambda q: loss(q, w))(p), per_example
        _, (hvp, dw) = jvp(both, (params,), (lam,))
        return (*hvp.values(), dw)

    a, b = double_backward(), forward_over_reverse()
    worst = max(float((u - v).abs().max() / v.abs().max()) for u, v in zip(a, b))
    print(f"# MLP 64-{args.hidden}-10, batch 32, fp32, {args.threads} thread(s), torch {torch.__version__}; "
          f"the two formulations agree to {worst:.1e} (relative)")
    best = {}
    for name, fn in (("train", train), ("double backward", double_backward),
                     ("forward over reverse", forward_over_reverse)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(50):
                fn()
            times.append((time.perf_counter() - start) / 50)
        best[name] = min(times)
    print("| step | ms | x train |\n|---|---:|---:|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.3f} | {seconds / best['train']:.2f} |")


if __name__ == "__main__":
    main()
