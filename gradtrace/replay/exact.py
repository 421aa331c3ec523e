"""The forward replay through torch's own optimizer kernels: the recorded trajectory bit for bit.

:func:`gradtrace.replay.optim.optimizer_step` is differentiable and follows torch.optim's single-tensor formulas op
for op; the foreach and fused kernels (the Trainer's default ``adamw_torch_fused``, ``Adam(fused=True)``) compute
the same formulas with other rounding, and over thousands of Adam steps on a chaotic loss surface that rounding
grows (a fused-Adam MLP run of 3,200 steps ended 6e-3 away, relative). So the states of the run -- the forward
replay and the recomputation of each reverse segment -- are computed here by torch's functional optimizers
(``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``) with the recorded kernel and ``clip_grad_norm_``'s default
path, on copies of the state: the same kernels on the same inputs give the recorded weights. Only the
vector-Jacobian products of the reverse pass use the differentiable formulas, evaluated at those exact states
(their derivatives are the kernels' derivatives; rounding aside the functions are the same).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_kernels
from torch.optim.sgd import sgd as sgd_kernels

from .optim import OptimState
from .spec import OptimizerSpec

__all__ = ["torch_step"]


def _clip(grads: list[Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (its default path) on the gradients, in place."""
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_([_Holder(g) for g in grads], max_norm, total)


class _Holder:
    """What ``clip_grads_with_norm_`` reads from a parameter: its ``.grad``."""

    def __init__(self, grad: Tensor) -> None:
        self.grad = grad


@torch.no_grad()
def torch_step(spec: OptimizerSpec, state: OptimState, grads: dict[str, Tensor | None], lrs: list[float],
               grad_clip: float | None = None) -> OptimState:
    """The step :func:`gradtrace.replay.optim.optimizer_step` computes, through torch's own kernels (the recorded
    ``implementation``) on copies: ``state`` is unchanged. Parameters without a gradient are left as they are."""
    names = [name for name in spec.param_names() if grads.get(name) is not None]
    clipped = {name: grads[name].detach().clone() for name in names}
    if grad_clip is not None and clipped:
        _clip(list(clipped.values()), grad_clip)
    params = {name: t.detach().clone() for name, t in state.params.items()}
    slots = {name: {slot: t.detach().clone() for slot, t in own.items()} for name, own in state.slots.items()}
    counts = dict(state.counts)
    fused = spec.implementation == "fused"
    foreach = spec.implementation == "foreach"
    for group, lr in zip(spec.groups, lrs):
        members = [name for name in group.params if name in clipped]
        if not members:
            continue
        hyper = group.hyper
        if spec.kind == "sgd":
            buffers = [slots.get(name, {}).get("momentum_buffer") for name in members]
            sgd_kernels([params[n] for n in members], [clipped[n] for n in members], buffers,
                                foreach=foreach, fused=fused, weight_decay=hyper["weight_decay"],
                                momentum=hyper["momentum"], lr=lr, dampening=hyper["dampening"],
                                nesterov=hyper["nesterov"], maximize=hyper["maximize"])
            for name, buf in zip(members, buffers):
                slots.setdefault(name, {})
                if buf is not None:
                    slots[name]["momentum_buffer"] = buf
                counts[name] = counts.get(name, 0) + 1
            continue
        for name in members:
            own = slots.setdefault(name, {})
            if "exp_avg" not in own:
                own["exp_avg"] = torch.zeros_like(params[name])
                own["exp_avg_sq"] = torch.zeros_like(params[name])
        steps = [torch.tensor(float(counts.get(n, 0)), dtype=torch.float32,
                              device=params[n].device if fused else "cpu") for n in members]
        beta1, beta2 = hyper["betas"]
        adam_kernels([params[n] for n in members], [clipped[n] for n in members],
                              [slots[n]["exp_avg"] for n in members], [slots[n]["exp_avg_sq"] for n in members], [],
                              steps, foreach=foreach, fused=fused, decoupled_weight_decay=spec.kind == "adamw",
                              amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=hyper["weight_decay"],
                              eps=hyper["eps"], maximize=hyper["maximize"])
        for name in members:
            counts[name] = counts.get(name, 0) + 1
    return OptimState(params, slots, counts)
