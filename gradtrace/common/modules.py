"""Naming a model's modules and parameters the same way whatever wraps it, and what its config says."""

from __future__ import annotations

from torch import nn

__all__ = ["canonical_param_names", "context_limit", "strip_wrappers", "unwrap"]

_WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def strip_wrappers(name: str) -> str:
    """A module/parameter name without the prefixes that FSDP1, activation checkpointing and
    ``torch.compile`` wrappers insert, so names match the unwrapped model's."""
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DataParallel / DistributedDataParallel / compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def canonical_param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``: the first name ``named_parameters()`` gives it (tied ones once)."""
    names: dict[int, str] = {}
    for name, param in unwrap(model).named_parameters():
        names.setdefault(id(param), strip_wrappers(name))
    return names


def context_limit(model: nn.Module) -> int | None:
    """The model's context length from its config (None when it does not say)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
