"""An independent reference: autograd through the fully unrolled training loop (create_graph at every step)."""

from __future__ import annotations

import torch

from .tasks import OPTIMIZERS, batcher, loss_fn, make_model, warmup_cosine


def unrolled_dloss_dw(kind: str, optimizer: str, steps: list, data: dict, queries: list, *, accumulation: int = 1,
                      grad_clip: float | None = None, warmup: int | None = None, weights_from: int = 0) -> torch.Tensor:
    """``dL_q/dw`` ``[Q, N]`` (columns: ids 0..N-1), written from the update formulas, not from the replay; with
    ``weights_from`` the weights act at steps ``weights_from ..`` only (ones before: the truncated pass's function)."""
    model = make_model(kind)
    hyper = OPTIMIZERS[optimizer](model.parameters()).param_groups[0]
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    start = dict(params)
    w = torch.ones(len(data), dtype=torch.float64, requires_grad=True)
    batches = batcher(data)
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for t, micro in enumerate(steps):
        lr = hyper["initial_lr"] if "initial_lr" in hyper else hyper["lr"]
        if warmup is not None:
            lr = lr * warmup_cosine(warmup, len(steps))(t)
        forward = lambda *a, params=params: torch.func.functional_call(model, params, a)
        grads = {n: 0.0 for n in names}
        for ids in micro:
            weight = w[ids] if t >= weights_from else torch.ones(len(ids), dtype=torch.float64)
            loss = (weight * loss_fn(forward, batches(ids))).sum() / len(ids) / accumulation
            got = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
            grads = {n: grads[n] + g for n, g in zip(names, got)}
        if grad_clip is not None:
            norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
            coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
            grads = {n: g * coef for n, g in grads.items()}
        new = {}
        for n in names:
            p, g = params[n], grads[n]
            if optimizer in ("sgd", "nesterov"):
                d = g + hyper["weight_decay"] * p
                m[n] = d if t == 0 else hyper["momentum"] * m[n] + (1 - hyper["dampening"]) * d
                d = d + hyper["momentum"] * m[n] if hyper["nesterov"] else m[n]
                new[n] = p - lr * d
            else:
                b1, b2 = hyper["betas"]
                if optimizer == "adamw":
                    p = p * (1 - lr * hyper["weight_decay"])
                else:
                    g = g + hyper["weight_decay"] * p
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                m_hat, v_hat = m[n] / (1 - b1 ** (t + 1)), v[n] / (1 - b2 ** (t + 1))
                new[n] = p - lr * m_hat / (torch.sqrt(v_hat) + hyper["eps"])
        params = new
    forward = lambda *a: torch.func.functional_call(model, params, a)
    rows = [torch.autograd.grad(query_loss(forward, q), w, retain_graph=True)[0] for q in queries]
    del start
    return torch.stack(rows)


def query_loss(forward, query) -> torch.Tensor:
    """Cross-entropy of one query example ``(x [d], y [])``."""
    x, y = query
    return torch.nn.functional.cross_entropy(forward(x[None]), y[None])
