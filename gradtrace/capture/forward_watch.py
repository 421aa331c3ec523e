"""Watches a captured layer's forward from its pre-hook to its forward hook (:meth:`LayerHandler.watch_forward`).

A rule that reads values its module's forward computes inside (the fused experts' hidden pre-activations:
``gradtrace.capture.layers.experts_forward``) returns a context manager from ``watch_forward``; it is entered in
the module's forward pre-hook and left in a forward hook that runs before the capture's layer hook, and also when
the forward raises (``always_call``), so that a failed call leaves no watch behind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .layers.base import LayerHandler

__all__ = ["watch_hooks"]


def watch_hooks(handler: LayerHandler) -> list[RemovableHandle]:
    """The two hooks that run ``handler.watch_forward`` around each forward call of its module with grad enabled
    (none for a rule that watches nothing)."""
    if type(handler).watch_forward is LayerHandler.watch_forward:
        return []
    active: list[Any] = []

    def enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        watch = handler.watch_forward(args, kwargs) if torch.is_grad_enabled() else None
        if watch is not None:
            watch.__enter__()
        active.append(watch)

    def leave(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        watch = active.pop() if active else None
        if watch is not None:
            watch.__exit__(None, None, None)

    module = handler.module
    return [module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True, prepend=True, always_call=True)]
