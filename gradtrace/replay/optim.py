"""Functional optimizer steps: torch.optim's single-tensor updates, differentiable in params, state and gradient.

Each function returns new tensors and changes none; the arithmetic is the one of ``torch.optim``'s
``_single_tensor_sgd`` / ``_single_tensor_adam`` (the ``foreach=False`` path, the default on the CPU) op for op,
so a replay on the CPU gives the recorded weights bit for bit when the loop used that path. The foreach path
(the default on CUDA) computes the same formulas with other kernels: the difference is rounding only.

* SGD: ``d = g + wd p``; ``b = d`` (first step) or ``mu b + (1 - dampening) d``; ``d = d + mu b`` (nesterov) or
  ``b``; ``p <- p - lr d``.
* Adam / AdamW: ``p <- p (1 - lr wd)`` (AdamW) or ``g <- g + wd p`` (Adam); ``m <- lerp(m, g, 1 - b1)``;
  ``v <- b2 v + (1 - b2) g^2``; ``p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
* clipping: ``N = ||(||g_k||_2)_k||_2``, ``g <- g * min(max_norm / (N + 1e-6), 1)`` (``clip_grad_norm_``).

One choice differs from plain autograd: ``d sqrt(v) / dv`` is taken as 0 where ``v == 0`` exactly (a parameter
whose gradient has always been 0, e.g. an unused embedding row), where ``sqrt`` has no derivative and autograd
would give ``inf * 0 = nan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .spec import OptimizerSpec

__all__ = ["OptimState", "adam_update", "clip_grad_norm", "init_state", "optimizer_step", "safe_sqrt",
           "sgd_update"]


@dataclass
class OptimState:
    """The state a step maps to the next: optimized parameters, optimizer buffers, per-parameter step counts.

    ``slots[name]`` holds ``momentum_buffer`` (SGD with momentum, after the first step) or ``exp_avg`` and
    ``exp_avg_sq`` (Adam); ``counts[name]`` is the number of updates the parameter received (Adam's ``step``).
    """

    params: dict[str, Tensor]
    slots: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def tensors(self) -> list[tuple[tuple[str, ...], Tensor]]:
        """Every tensor of the state with its key: ``("param", name)`` or ``("slot", name, slot)``, sorted."""
        out = [(("param", name), t) for name, t in self.params.items()]
        out += [(("slot", name, slot), t) for name, slots in self.slots.items() for slot, t in sorted(slots.items())]
        return out

    def replace(self, values: dict[tuple[str, ...], Tensor]) -> OptimState:
        """A copy with the tensors at ``values``' keys replaced (the step counts kept)."""
        params = {name: values.get(("param", name), t) for name, t in self.params.items()}
        slots = {name: {slot: values.get(("slot", name, slot), t) for slot, t in s.items()}
                 for name, s in self.slots.items()}
        return OptimState(params, slots, dict(self.counts))

    def detached(self) -> OptimState:
        """The same state with every tensor detached."""
        return self.replace({key: t.detach() for key, t in self.tensors()})


def init_state(params: dict[str, Tensor]) -> OptimState:
    """The state before the first step: the given parameters, no buffers, no counts."""
    return OptimState(dict(params))


def safe_sqrt(value: Tensor) -> Tensor:
    """``sqrt(value)`` with the same bits, and derivative 0 where ``value == 0`` (instead of ``inf``)."""
    positive = value > 0
    return torch.where(positive, torch.where(positive, value, torch.ones_like(value)).sqrt(), torch.zeros_like(value))


def clip_grad_norm(grads: list[Tensor], max_norm: float) -> tuple[list[Tensor], Tensor]:
    """Scale gradients as ``torch.nn.utils.clip_grad_norm_(..., max_norm)`` does (2-norm, foreach=False).

    Args:
        grads: the gradients of the parameters (None entries left out by the caller).
        max_norm: the clipping threshold.

    Returns:
        the scaled gradients ``g * min(max_norm / (N + 1e-6), 1)`` and the total norm ``N``.
    """
    if not grads:
        return [], torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    return [g.mul(clip_coef_clamped.to(g.device)) for g in grads], total_norm


def sgd_update(param: Tensor, grad: Tensor, buf: Tensor | None, lr: float,
               hyper: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """One ``torch.optim.SGD`` update of one parameter.

    Args:
        param, grad: the parameter and its (clipped) gradient.
        buf: the momentum buffer, None before the first step (or without momentum).
        lr: this step's learning rate.
        hyper: ``momentum``, ``dampening``, ``nesterov``, ``weight_decay``, ``maximize``.

    Returns:
        the new parameter and momentum buffer (None without momentum).
    """
    grad = grad if not hyper["maximize"] else -grad
    if hyper["weight_decay"] != 0:
        grad = grad.add(param, alpha=hyper["weight_decay"])
    momentum = hyper["momentum"]
    if momentum != 0:
        buf = grad if buf is None else buf.mul(momentum).add(grad, alpha=1 - hyper["dampening"])
        grad = grad.add(buf, alpha=momentum) if hyper["nesterov"] else buf
    return param.add(grad, alpha=-lr), buf


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float,
                hyper: dict[str, Any], decoupled: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One ``torch.optim.Adam`` (``decoupled=False``) or ``AdamW`` (``decoupled=True``) update, amsgrad off.

    Args:
        param, grad: the parameter and its (clipped) gradient.
        exp_avg, exp_avg_sq: the moment estimates before the step (zeros before the first).
        step: the step count *after* this update (1 on the first).
        lr: this step's learning rate.
        hyper: ``betas``, ``eps``, ``weight_decay``, ``maximize``.
        decoupled: AdamW's decoupled weight decay.

    Returns:
        the new parameter, ``exp_avg`` and ``exp_avg_sq``.
    """
    grad = grad if not hyper["maximize"] else -grad
    beta1, beta2 = hyper["betas"]
    weight_decay = hyper["weight_decay"]
    if weight_decay != 0:
        if decoupled:
            param = param.mul(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg = torch.lerp(exp_avg, grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (safe_sqrt(exp_avg_sq) / bias_correction2_sqrt).add(hyper["eps"])
    return torch.addcdiv(param, exp_avg, denom, value=-step_size), exp_avg, exp_avg_sq


def optimizer_step(spec: OptimizerSpec, state: OptimState, grads: dict[str, Tensor | None], lrs: list[float],
                   grad_clip: float | None = None) -> OptimState:
    """One optimizer step over every group: clip (when ``grad_clip``), then update each parameter.

    A parameter whose gradient is None is left as it is, buffers and count included (as torch.optim skips
    parameters without ``.grad``).

    Args:
        spec: the optimizer kind and groups.
        state: the state before the step.
        grads: the gradient of each optimized parameter (None: not reached by the loss).
        lrs: the learning rate of each group at this step.
        grad_clip: the clipping max norm, or None.

    Returns:
        the state after the step (new tensors; ``state`` is unchanged).
    """
    names = [name for name in spec.param_names() if grads.get(name) is not None]
    present = [grads[name] for name in names]
    if grad_clip is not None:
        present, _ = clip_grad_norm(present, grad_clip)
    clipped = dict(zip(names, present))
    params, slots, counts = dict(state.params), {k: dict(v) for k, v in state.slots.items()}, dict(state.counts)
    for group, lr in zip(spec.groups, lrs):
        for name in group.params:
            if name not in clipped:
                continue
            param, grad, own = params[name], clipped[name], slots.setdefault(name, {})
            counts[name] = counts.get(name, 0) + 1
            if spec.kind == "sgd":
                params[name], buf = sgd_update(param, grad, own.get("momentum_buffer"), lr, group.hyper)
                if buf is not None:
                    own["momentum_buffer"] = buf
            else:
                zeros = torch.zeros_like(param) if "exp_avg" not in own else None
                params[name], own["exp_avg"], own["exp_avg_sq"] = adam_update(
                    param, grad, own.get("exp_avg", zeros), own.get("exp_avg_sq", zeros), counts[name], lr,
                    group.hyper, decoupled=spec.kind == "adamw")
            if not own:
                del slots[name]
    return OptimState(params, slots, counts)
