"""Meta-learned data reweighting with SAMA's approximations (Choe et al. 2023).

Each training example (or data source) ``i`` has a logit ``lambda_i`` and a weight ``w_i = sigmoid(lambda_i)``;
the loop trains on ``L_base = mean_i w_i l_i(theta)``. The weights are learned so that the optimizer's next
step lowers a meta (validation) loss ``L_meta``. With SAMA's approximations -- base Jacobian as identity, the
optimizer's update Jacobian ``D = du/dg`` kept (SGD: ``lr``; Adam: its exact elementwise derivative), and a
central finite difference for the mixed second-order term -- the meta-gradient of example ``i`` is

    dL_meta/dlambda_i = -(sigmoid'(lambda_i) / B) * g_i^T (D * grad L_meta)
                      ~ -(sigmoid'(lambda_i) / B) * [l_i(theta + eps v) - l_i(theta - eps v)] / (2 eps),

with ``v = D * grad L_meta`` and ``eps = alpha / |v|``: one meta backward pass and two extra forward passes of the
training batch per meta step, no per-example gradients and no Hessian. The parameters are restored exactly
(copied back) after the probes. ``scores`` (``> 0``: a step on the example lowers the meta loss) are kept per
example; weights and scores can rank examples for pruning afterwards.

Usage (the loss line is the only change to a loop)::

    sama = SAMAReweighting(model, optimizer, meta_batches, loss_fn=per_example_loss,
                           options=ReweightingOptions(meta_lr=0.5))
    for batch in loader:
        loss = sama.loss(batch)                     # mean_i w_i l_i, and the batch is remembered
        loss.backward()
        optimizer.step(); optimizer.zero_grad()     # the meta step runs in a pre-hook of optimizer.step()
    sama.weights                                    # {example id: weight}
    sama.save("runs/sama-weights.json")             # weights, scores and the state to resume from
    keep = sama.keep(fraction=0.7)                  # the ids to keep when pruning the dataset
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..common.checks import finite
from ..common.checks import fraction as checked_fraction
from ..loss.functions import LossFn
from ..options.train import ReweightingOptions
from ..store.artifact import atomic_write_json
from .cycle import Cycle

__all__ = ["SAMAReweighting", "adam_update_jacobian"]


def adam_update_jacobian(optimizer: torch.optim.Optimizer, param: nn.Parameter, grad: Tensor) -> Tensor:
    """Elementwise ``du/dg`` of Adam/AdamW's update ``u = lr * mhat / (sqrt(vhat) + eps)`` at gradient ``grad``
    (the moments updated with it, bias-corrected at the next step); ``lr`` for parameters without state yet."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    lr = float(group["lr"])
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    eps = float(group.get("eps", 1e-8))
    state = optimizer.state.get(param, {})
    if "exp_avg" not in state:
        m_old = torch.zeros_like(grad)
        v_old = torch.zeros_like(grad)
        step = 1
    else:
        m_old, v_old = state["exp_avg"], state["exp_avg_sq"]
        step = int(float(state["step"])) + 1
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    m = beta1 * m_old + (1 - beta1) * grad
    v = beta2 * v_old + (1 - beta2) * grad * grad
    root = (v / bc2).sqrt()
    denom = root + eps
    dm = (1 - beta1) / bc1
    # d/dg sqrt(v/bc2) = (1 - beta2) g / (bc2 * sqrt(v/bc2))
    droot = (1 - beta2) * grad / (bc2 * root.clamp(min=1e-30))
    return lr * (dm / denom - (m / bc1) * droot / denom**2)


@dataclass
class _Remembered:
    batch: Any
    ids: list[str]


class SAMAReweighting:
    """Learns a weight per training example (or per data source) with SAMA (see module docstring).

    Args:
        model, optimizer: the loop's; the meta step runs in ``optimizer``'s step pre-hook (SGD without momentum,
            or Adam/AdamW: another optimizer raises ``TypeError`` at its first meta step).
        meta_data: batches of the meta (validation) set, re-iterated when exhausted.
        loss_fn: ``loss_fn(model, batch) -> [B]`` per-example losses (training and meta batches).
        groups: ``{example id: source}`` to learn one weight per data source instead of per example.
        options: the settings (:class:`gradtrace.options.train.ReweightingOptions`; default: its defaults).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, meta_data: Iterable[Any], *,
                 loss_fn: LossFn, groups: dict[str, str] | None = None,
                 options: ReweightingOptions | None = None) -> None:
        options = ReweightingOptions() if options is None else options
        if not isinstance(options, ReweightingOptions):
            raise TypeError(f"options= must be a ReweightingOptions, got {type(options).__name__}")
        self.options = options
        self.model = model
        self.optimizer = optimizer
        self.meta_data = meta_data
        self._meta = Cycle(meta_data, "meta batches")
        self.loss_fn = loss_fn
        self.groups = groups
        self.init_logit = float(options.init_logit)
        self.logits: dict[str, Tensor] = {}
        self.scores: dict[str, float] = {}
        self._remembered: list[_Remembered] = []
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._moments: dict[str, tuple[float, float, int]] = {}
        self._steps = 0
        self.history: list[dict[str, float]] = []
        self._handle = optimizer.register_step_pre_hook(self._before_step)

    def close(self) -> None:
        """Remove the optimizer hook."""
        self._handle.remove()

    # -- weights -------------------------------------------------------------------------------------
    def _key(self, ident: str) -> str:
        if self.groups is None:
            return ident
        try:
            return self.groups[ident]
        except KeyError:
            raise KeyError(f"example {ident!r} has no group in groups=") from None

    def weight_tensor(self, ids: list[str], device: torch.device | None = None) -> Tensor:
        """``[B]`` current weights ``sigmoid(lambda)`` of ``ids`` (new ids start at ``init_logit``)."""
        values = torch.tensor([float(self.logits.get(self._key(i), self.init_logit)) for i in ids])
        return torch.sigmoid(values).to(device) if device is not None else torch.sigmoid(values)

    @property
    def weights(self) -> dict[str, float]:
        """``{example id or source: weight}`` learned so far."""
        return {k: float(torch.sigmoid(v)) for k, v in self.logits.items()}

    def keep(self, *, fraction: float | None = None, threshold: float | None = None) -> list[str]:
        """Ids (or sources) to keep when pruning the data afterwards: the ``fraction`` with the highest weights,
        or those with weight ``>= threshold`` (exactly one of the two)."""
        if (fraction is None) == (threshold is None):
            raise ValueError("pass exactly one of fraction= and threshold=")
        weights = self.weights
        if threshold is not None:
            threshold = finite(threshold, "threshold")
            return [k for k, w in weights.items() if w >= threshold]
        fraction = checked_fraction(fraction, "fraction")
        ranked = sorted(weights, key=lambda k: (-weights[k], k))
        return ranked[: round(fraction * len(ranked))]

    # -- saving and resuming --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything learned so far (logits, their Adam moments, scores, the step count), JSON-serialisable."""
        return {"logits": {k: float(v) for k, v in self.logits.items()},
                "moments": {k: list(m) for k, m in self._moments.items()},
                "scores": dict(self.scores), "steps": self._steps, "init_logit": self.init_logit,
                "per": "source" if self.groups is not None else "example"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (e.g. when training resumes from a checkpoint)."""
        per = "source" if self.groups is not None else "example"
        if state.get("per", "example") != per:
            raise ValueError(f"these SAMA weights are per {state.get('per')}, this callback learns them per {per}")
        self.logits = {k: torch.tensor(float(v)) for k, v in state["logits"].items()}
        self._moments = {k: (float(m[0]), float(m[1]), int(m[2])) for k, m in state.get("moments", {}).items()}
        self.scores = {k: float(v) for k, v in state.get("scores", {}).items()}
        self._steps = int(state.get("steps", 0))

    def save(self, path: str | Path) -> Path:
        """Write the weights and :meth:`state_dict` to a JSON file (atomically); returns its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": "gradtrace-sama", "version": 1, "weights": self.weights,
                                 "state": self.state_dict()})
        return path

    @staticmethod
    def load(path: str | Path) -> dict[str, Any]:
        """Read a file written by :meth:`save`: ``{"weights": {...}, "state": {...}}`` (pass ``["state"]`` to
        :meth:`load_state_dict` to resume)."""
        with open(path) as f:
            payload = json.load(f)
        if payload.get("format") != "gradtrace-sama":
            raise ValueError(f"{path} is not a SAMA weights file written by SAMAReweighting.save")
        return payload

    def loss(self, batch: Any, ids: list[str] | None = None) -> Tensor:
        """The weighted training loss ``mean_i w_i l_i`` of ``batch`` (remembered for the next meta step)."""
        ids = self._ids(batch, ids)
        inputs = self._strip(batch)
        losses = self.loss_fn(self.model, inputs)
        if losses.shape != (len(ids),):
            raise ValueError(f"loss_fn must return one loss per example ([{len(ids)}]), got {tuple(losses.shape)}")
        weights = self.weight_tensor(ids, losses.device).to(losses.dtype)
        self._remembered.append(_Remembered(inputs, ids))
        total = (weights * losses).mean()
        return total / weights.mean().clamp(min=1e-12) if self.options.normalize else total

    def _ids(self, batch: Any, ids: list[str] | None) -> list[str]:
        if ids is not None:
            return [str(i) for i in ids]
        if isinstance(batch, dict) and self.options.id_key in batch:
            value = batch[self.options.id_key]
            return [str(i) for i in (value.tolist() if isinstance(value, Tensor) else value)]
        raise ValueError(f"SAMA needs example ids: put them in batch[{self.options.id_key!r}] or pass ids=")

    def _strip(self, batch: Any) -> Any:
        return {k: v for k, v in batch.items() if k != self.options.id_key} if isinstance(batch, dict) else batch

    # -- the meta step -------------------------------------------------------------------------------
    def _meta_batch(self) -> Any:
        return self._strip(self._meta.next())

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        remembered, self._remembered = self._remembered, []
        self._steps += 1
        step, first = self._steps - 1, self.options.start_step
        if not remembered or step < first or (step - first) % self.options.interval:
            return
        meta_loss = self.loss_fn(self.model, self._meta_batch()).mean()
        meta_grads = torch.autograd.grad(meta_loss, self._params, allow_unused=True)
        direction = []
        for param, gm in zip(self._params, meta_grads):
            if gm is None or param.grad is None:
                direction.append(None)
                continue
            if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                jac = adam_update_jacobian(self.optimizer, param, param.grad)
            elif isinstance(self.optimizer, torch.optim.SGD) and not self.optimizer.defaults.get("momentum"):
                jac = torch.full_like(param, float(self._group_lr(param)))
            else:
                raise TypeError(f"SAMA supports SGD (no momentum) and Adam/AdamW, got {type(self.optimizer).__name__}")
            direction.append(jac * gm)
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in direction if d is not None))
        if norm == 0.0:
            return
        eps = float(self.options.alpha) / norm
        saved = [p.detach().clone() for p in self._params]
        try:
            plus = self._probe(remembered, direction, eps)
            self._restore(saved)
            minus = self._probe(remembered, direction, -eps)
        finally:
            self._restore(saved)
        scores = {}
        for item, lp, lm in zip(remembered, plus, minus):
            diff = ((lp - lm) / (2 * eps)).tolist()  # g_i . v: > 0 when a step on i lowers the meta loss
            for ident, value in zip(item.ids, diff):
                scores[ident] = value
        self._update(scores, sum(len(r.ids) for r in remembered))
        self.history.append({"step": self._steps - 1, "meta_loss": float(meta_loss.detach())})

    def _group_lr(self, param: nn.Parameter) -> float:
        return next(g["lr"] for g in self.optimizer.param_groups if any(p is param for p in g["params"]))

    @torch.no_grad()
    def _probe(self, remembered: list[_Remembered], direction: list[Tensor | None], eps: float) -> list[Tensor]:
        for param, d in zip(self._params, direction):
            if d is not None:
                param.add_(d, alpha=eps)
        return [self.loss_fn(self.model, item.batch).detach().to(torch.float64) for item in remembered]

    @torch.no_grad()
    def _restore(self, saved: list[Tensor]) -> None:
        for param, value in zip(self._params, saved):
            param.copy_(value)

    def _update(self, scores: dict[str, float], batch_size: int) -> None:
        """Adam step on the logits with gradient ``-sigmoid'(lambda) * score / B`` (summed per group)."""
        grads: dict[str, float] = {}
        for ident, score in scores.items():
            key = self._key(ident)
            logit = float(self.logits.get(key, self.init_logit))
            s = 1.0 / (1.0 + math.exp(-logit))
            grads[key] = grads.get(key, 0.0) - s * (1 - s) * score / batch_size
            self.scores[ident] = self.scores.get(ident, 0.0) * 0.5 + score * 0.5 if ident in self.scores else score
        for key, grad in grads.items():
            m, v, t = self._moments.get(key, (0.0, 0.0, 0))
            t += 1
            m = 0.9 * m + 0.1 * grad
            v = 0.999 * v + 0.001 * grad * grad
            step = float(self.options.meta_lr) * (m / (1 - 0.9**t)) / (math.sqrt(v / (1 - 0.999**t)) + 1e-8)
            self.logits[key] = torch.tensor(float(self.logits.get(key, self.init_logit)) - step)
            self._moments[key] = (m, v, t)
