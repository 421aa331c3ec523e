"""Layers called on the tokens of a forward call flattened into one dim (``[B*T, d]``), as MoE blocks call theirs.

A mixture-of-experts block flattens its input to ``[B*T, d]`` before calling its router, its experts and (in
Qwen2-MoE or DeepSeek) its shared experts; the capture views such tensors as the call's rows ``[B, T, ...]`` (the
flattening is row-major: token ``t`` of row ``b`` is ``b*T + t``), so these layers map to examples like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from .context import ForwardContext

__all__ = ["flat_tokens", "match_rows", "output_tensors", "row_view"]


def flat_tokens(context: Any, inputs: Tensor, output: Tensor) -> int | None:
    """``T`` when a layer's input and output are the call's tokens flattened into their first dim (``[B*T, d]``, as
    mixture-of-experts blocks call their experts, router and shared experts), else None."""
    if not isinstance(context, ForwardContext) or context.seq_len is None or inputs.dim() != 2:
        return None
    tokens = context.seq_len
    flat = context.batch_size * tokens
    if inputs.shape[0] != flat or output.dim() < 1 or output.shape[0] != flat or flat == context.batch_size:
        return None
    return tokens


def row_view(context: Any, tensor: Tensor) -> Callable[[Tensor], Tensor]:
    """A function viewing a tensor of ``tensor``'s layout as rows ``[B, T, ...]`` when its first dim holds the call's
    flattened tokens (``[B*T, ...]``); the identity otherwise."""
    if (not isinstance(context, ForwardContext) or context.seq_len is None or tensor.dim() != 2
            or tensor.shape[0] != context.batch_size * context.seq_len or context.seq_len == 1):
        return lambda x: x
    rows, tokens = context.batch_size, context.seq_len
    return lambda x: x.view(rows, tokens, *x.shape[1:])


def match_rows(context: Any, inputs: Tensor, output: Tensor, whole: Any,
               expand: bool) -> tuple[Tensor, Tensor | None] | str:
    """A layer call's batch input as the call's rows: ``(inputs, expanded output or None)``, or why its rows cannot be
    matched to the call's examples.

    inputs: the call's batch input; output: the output tensor whose gradient the rule needs (``whole``: the call's
    whole output). Flattened tokens (:func:`flat_tokens`) are viewed as ``[B, T, ...]``; with ``expand``, a batch-shared
    call (input and output of one row, GPT-2's position embedding) is expanded to every row.
    """
    tokens = flat_tokens(context, inputs, output)
    if tokens is not None:
        return inputs.view(context.batch_size, tokens, *inputs.shape[1:]), None
    if not isinstance(context, ForwardContext) or inputs.shape[0] == context.batch_size:
        return inputs, None
    rows = context.batch_size
    if output is whole and inputs.shape[0] == 1 and output.dim() >= 1 and output.shape[0] == 1 and expand:
        return inputs.expand(rows, *inputs.shape[1:]), output.expand(rows, *output.shape[1:])
    return f"its input has {inputs.shape[0]} rows but the batch has {rows}; rows cannot be matched to examples"


def output_tensors(output: Any) -> list[Tensor]:
    """The tensors of a forward call's output (a tensor, or a dict, tuple or list holding tensors)."""
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return [v for v in values if isinstance(v, Tensor)]
