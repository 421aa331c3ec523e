"""What a recorded run must say to be replayed: the optimizer, its parameter groups, the loss reduction.

Everything here is plain data that goes into the run's JSON manifest (``manifest.json`` of a run directory) and
comes back from it unchanged. Only optimizers whose update :mod:`gradtrace.replay.optim` reproduces exactly are
accepted: ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize) and ``torch.optim.Adam`` /
``torch.optim.AdamW`` (betas, eps, weight decay, maximize; ``amsgrad=False``), not capturable, not
differentiable. The kernels the run used (single-tensor, foreach, or fused: the Trainer's default
``adamw_torch_fused``) are recorded as ``implementation``; the replay's states go through those very kernels
(:mod:`gradtrace.replay.exact`), and the replay's check of the final weights bounds what remains.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..common.errors import UsageError

__all__ = ["SCHEMA", "GroupSpec", "OptimizerSpec", "Reduction", "ReplayError", "optimizer_spec"]

SCHEMA = "gradtrace.replay/1"

# the hyper-parameters each optimizer kind keeps, besides ``lr`` (recorded per step)
HYPER: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum", "dampening", "nesterov", "weight_decay", "maximize"),
    "adam": ("betas", "eps", "weight_decay", "maximize"),
    "adamw": ("betas", "eps", "weight_decay", "maximize"),
}
KINDS: dict[type, str] = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
# flags that must have these values for the update to be the one replayed
REQUIRED = {"amsgrad": False, "capturable": False, "differentiable": False}


class ReplayError(UsageError):
    """A run that cannot be recorded or replayed exactly (an unsupported optimizer, missing ids, a model that does
    not match the recorded weights, a replay that drifted past its bound)."""


@dataclass(frozen=True)
class Reduction:
    """How a micro-batch's per-example losses ``l_i`` become the loss the loop differentiates.

    ``kind="mean"``: ``sum_i w_i l_i / B``; ``kind="sum"``: ``sum_i w_i l_i``; ``kind="token_mean"``: ``l_i`` is
    example ``i``'s *summed* token loss and ``loss_fn`` returns ``(losses, counts)`` with ``counts[i]`` its number
    of loss tokens: ``sum_i w_i l_i / sum_i counts_i`` over the micro-batch, or over every micro-batch of the
    optimizer step when ``num_items_in_batch`` (the Hugging Face Trainer's ``num_items_in_batch``).
    ``divide_by_accumulation``: the loop divides each micro-batch loss by the accumulation steps (a plain loop's
    ``loss / accum``; the Trainer does not when it passes ``num_items_in_batch``). The weights ``w_i`` (1 in the
    recorded run) are in the numerators only; the denominators do not depend on them.
    """

    kind: str = "mean"
    num_items_in_batch: bool = False
    divide_by_accumulation: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("mean", "sum", "token_mean"):
            raise ReplayError(f"Reduction(kind={self.kind!r}): expected 'mean', 'sum' or 'token_mean'")
        if self.num_items_in_batch and self.kind != "token_mean":
            raise ReplayError("Reduction(num_items_in_batch=True) needs kind='token_mean'")

    def to_dict(self) -> dict[str, Any]:
        """The reduction as JSON-ready fields."""
        return asdict(self)


@dataclass(frozen=True)
class GroupSpec:
    """One parameter group: the names of its parameters (as ``model.named_parameters()`` spells them) and its
    hyper-parameters other than ``lr``."""

    params: tuple[str, ...]
    hyper: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of a recorded run: its kind (``"sgd"``, ``"adam"``, ``"adamw"``) and its groups."""

    kind: str
    groups: tuple[GroupSpec, ...]
    implementation: str = "single-tensor"  # or "foreach" / "fused": which torch kernels the recorded run used

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready fields."""
        return {"kind": self.kind, "implementation": self.implementation,
                "groups": [{"params": list(g.params), "hyper": g.hyper} for g in self.groups]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerSpec:
        """Rebuild a spec written by :meth:`to_dict`.

        Raises:
            ReplayError: an unknown optimizer kind.
        """
        if data.get("kind") not in HYPER:
            raise ReplayError(f"recorded optimizer kind {data.get('kind')!r} is not one of {sorted(HYPER)}")
        groups = tuple(GroupSpec(tuple(g["params"]), _normalised(g["hyper"])) for g in data["groups"])
        return cls(data["kind"], groups, data.get("implementation", "single-tensor"))

    def param_names(self) -> list[str]:
        """Every optimized parameter's name, group by group."""
        return [name for group in self.groups for name in group.params]


def _normalised(hyper: dict[str, Any]) -> dict[str, Any]:
    out = dict(hyper)
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return out


def _scalar(value: Any, what: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad:
            raise ReplayError(f"optimizer hyper-parameter {what} is a tensor that cannot be recorded as a number")
        return value.item()
    return value


def group_hyper(kind: str, group: dict[str, Any]) -> dict[str, Any]:
    """The replayed hyper-parameters of one ``optimizer.param_groups`` entry (``lr`` excluded).

    Raises:
        ReplayError: a flag (``amsgrad``, ``fused``, ``capturable``, ``differentiable``) the replay cannot follow.
    """
    for flag, wanted in REQUIRED.items():
        if flag in group and bool(group[flag]) != bool(wanted):
            raise ReplayError(f"optimizer option {flag}={group[flag]!r} is not supported by the replay "
                              f"(supported: {flag}={wanted!r})")
    hyper = {}
    for key in HYPER[kind]:
        value = group[key]
        hyper[key] = tuple(float(_scalar(b, key)) for b in value) if key == "betas" else _scalar(value, key)
    return hyper


def optimizer_spec(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimizerSpec:
    """Describe ``optimizer`` for replay; ``names`` maps ``id(parameter)`` to its name in the model.

    Returns:
        the kind and the groups (parameter names and hyper-parameters).

    Raises:
        ReplayError: an optimizer other than SGD / Adam / AdamW (subclasses included), unsupported flags, a
            parameter that is not the model's, or an optimizer that already holds state (a resumed run).
    """
    kind = KINDS.get(type(optimizer))
    if kind is None:
        raise ReplayError(f"cannot replay optimizer {type(optimizer).__name__}: supported are torch.optim.SGD, "
                          "torch.optim.Adam and torch.optim.AdamW (exact classes)")
    if any(len(s) for s in optimizer.state.values()):
        raise ReplayError("the optimizer already holds state (a resumed run): record from a fresh optimizer")
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for param in group["params"]:
            if id(param) not in names:
                raise ReplayError(f"param_groups[{index}] holds a tensor that is not a parameter of the model")
            params.append(names[id(param)])
        groups.append(GroupSpec(tuple(params), group_hyper(kind, group)))
    first = optimizer.param_groups[0] if optimizer.param_groups else {}
    on_cpu = all(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"])
    implementation = ("fused" if first.get("fused") else "foreach" if first.get("foreach")
                      or (first.get("foreach") is None and not on_cpu) else "single-tensor")
    return OptimizerSpec(kind, tuple(groups), implementation)
