"""The layer-handler protocol and its registry.

A handler holds the per-example gradient math of one module kind and nothing else: which tensor of
the forward call carries the batch, what to keep from the forward pass (activations, possibly
projected), and how to turn the output-gradient into per-example gradient terms. Orchestration
(hooks, batching, ids, loss scale) lives in the collector.

Adding a layer kind is one file with a subclass decorated by :func:`register_layer`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from ...grad.projection import Projector
from ...grad.terms import Term

__all__ = ["LayerHandler", "register_layer", "find_handler", "registered_handlers", "TokenScale"]

TokenScale = Callable[[int, torch.device], Tensor]
"""``scale(num_tokens, device) -> [B, num_tokens]`` float32: the per-token factor turning hook
gradients into per-example loss gradients (the collector supplies it, per forward call)."""

_REGISTRY: list[type["LayerHandler"]] = []


def register_layer(cls: type["LayerHandler"]) -> type["LayerHandler"]:
    """Class decorator adding a handler to the registry (later registrations take precedence)."""
    _REGISTRY.insert(0, cls)
    return cls


def registered_handlers() -> list[type["LayerHandler"]]:
    return list(_REGISTRY)


def find_handler(module: nn.Module) -> type["LayerHandler"] | None:
    """The handler class for ``module``, or None when no registered kind matches."""
    for cls in _REGISTRY:
        if cls.matches(module):
            return cls
    return None


class LayerHandler:
    """Per-example gradient math of one module kind.

    Subclasses set ``kind``, implement :meth:`matches`, :meth:`param_roles`, :meth:`forward`,
    :meth:`backward`, and may override :meth:`unsupported_reason` and :meth:`batch_input`.

    Attributes:
        name: module name inside the model.
        module: the module (never modified).
        params: ``role -> parameter name`` for the parameters being captured (e.g. "weight").
        shapes: ``role -> shape of one example's gradient`` for those parameters.
    """

    kind: ClassVar[str] = "layer"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.shapes = {role: tuple(getattr(module, role).shape) for role in params}

    @classmethod
    def matches(cls, module: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def param_roles(cls, module: nn.Module) -> tuple[str, ...]:
        """Attribute names of the parameters this handler can capture."""
        return ("weight", "bias")

    def unsupported_reason(self) -> str | None:
        """Why this particular module cannot be captured per example (None when it can)."""
        return None

    def batch_input(self, args: tuple, kwargs: dict) -> Tensor:
        """The forward-call tensor whose first dimension is the batch."""
        if args and isinstance(args[0], Tensor):
            return args[0]
        for value in kwargs.values():
            if isinstance(value, Tensor):
                return value
        raise ValueError(f"{self.name}: no tensor input found in the forward call")

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        """Called in the forward hook; returns what :meth:`backward` needs."""
        raise NotImplementedError  # pragma: no cover

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        """Per-row gradient terms ``{role: term with leading dims [B, T]}`` from the output gradient.

        ``scale`` gives the per-token loss-scale factors; the returned terms must include them.
        """
        raise NotImplementedError  # pragma: no cover

    def describe(self) -> str:
        return f"{self.kind}({type(self.module).__name__})"


def tokens_last(x: Tensor, width: int) -> Tensor:
    """Reshape ``[B, ..., width]`` to ``[B, T, width]`` with ``T`` the product of middle dims."""
    if x.dim() < 2:
        raise ValueError(f"expected a batched input of shape [batch, ..., {width}], got {tuple(x.shape)}")
    return x.reshape(x.shape[0], -1, width)


def scaled(x: Tensor, scale: TokenScale) -> Tensor:
    """Multiply ``x`` ``[B, T, n]`` by the per-token scale (result in x's dtype, computed in fp32)."""
    factor = scale(x.shape[1], x.device)
    if x.dtype == torch.float32:
        return x * factor.unsqueeze(-1)
    return (x.to(torch.float32) * factor.unsqueeze(-1)).to(x.dtype)
