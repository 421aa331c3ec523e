"""Layers called on the tokens of a forward call flattened into one dim (``[B*T, d]``), as MoE blocks call theirs.

A mixture-of-experts block flattens its input to ``[B*T, d]`` before calling its router, its experts and (in
Qwen2-MoE or DeepSeek) its shared experts; the capture views such tensors as the call's rows ``[B, T, ...]`` (the
flattening is row-major: token ``t`` of row ``b`` is ``b*T + t``), so these layers map to examples like any other.

**Batch-shared calls.** A layer called once for the whole batch -- GPT-2's position embedding on ``[1, T]`` ids, or
``self.pos(torch.arange(T))`` whose ``[T, d]`` output is broadcast onto the token embeddings ``[B, T, d]`` -- has an
output gradient summed over the batch; example ``b``'s share is the ``b``-th slice of the gradient of the broadcast
result. With ``broadcast="expand"`` the call's output is replaced by its expansion to every row (a view: no copy),
whose gradient is exactly those slices, and its input by the input expanded the same way, so the layer's rule gives
example ``b``'s gradient from its own share (exact, padded and LoGra capture, per-token rows alike). An output
``[1, ...]`` is expanded along its own first dim (values and the result of broadcasting are unchanged). An output
without a batch dim (``[T, ...]`` from an input of the call's ``T`` positions) gains one, ``[B, T, ...]``, and is
returned as :class:`SharedRows`, which guards that this changes nothing the model computes: elementwise arithmetic
with the batch's rows (``tok + pos``: broadcasting ``[T, d]`` against ``[B, T, d]`` is that expansion) gives a plain
tensor of the same values; elementwise arithmetic with scalars (or another such output), ``to`` / ``contiguous`` /
``clone`` and adding or dropping a leading 1 (``unsqueeze(0)``, ``[None]``, ``view(1, T, d)``, ``squeeze(0)``) keep
it shared; any other use (a shape, a view, an index, a matmul, dropout) would see ``B`` rows where the model has none
and raises, naming ``CaptureOptions(broadcast="skip")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .context import ForwardContext

__all__ = ["SharedRows", "batch_shared", "flat_tokens", "match_rows", "output_tensors", "row_view", "shared_rows"]


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
    if output is whole and expand and _positions_only(context, inputs, output):
        return inputs.unsqueeze(0).expand(rows, *inputs.shape), shared_rows(output, rows)
    return f"its input has {inputs.shape[0]} rows but the batch has {rows}; rows cannot be matched to examples"


def batch_shared(context: ForwardContext, inputs: Tensor, output: Tensor) -> bool:
    """Whether a call is computed once for the whole batch: a ``[1, ...]`` input, or the call's ``T`` positions
    without a batch dim (what ``broadcast="skip"`` leaves out on purpose)."""
    return inputs.shape[0] == 1 or _positions_only(context, inputs, output)


def _positions_only(context: ForwardContext, inputs: Tensor, output: Tensor) -> bool:
    """Whether a call has no batch dim but the call's ``T`` positions (``[T]`` ids, or ``[T, d]`` features) in and
    out: a batch-shared call such as ``self.pos(torch.arange(T))``."""
    tokens = context.seq_len
    return (tokens is not None and tokens != context.batch_size and inputs.dim() >= 1 and output.dim() >= 2
            and inputs.shape[0] == tokens and output.shape[0] == tokens and inputs.dim() in (1, output.dim()))


_ARITHMETIC = {Tensor.add, Tensor.__add__, Tensor.__radd__, Tensor.sub, Tensor.__sub__, Tensor.__rsub__, Tensor.mul,
               Tensor.__mul__, Tensor.__rmul__, Tensor.div, Tensor.__truediv__, Tensor.__rtruediv__, torch.add,
               torch.sub, torch.mul, torch.div, torch.where}
_INTO = {Tensor.add_, Tensor.__iadd__, Tensor.sub_, Tensor.__isub__, Tensor.mul_, Tensor.__imul__}  # batch += shared
_ROWWISE = {Tensor.to, Tensor.contiguous, Tensor.clone, Tensor.float, Tensor.neg, Tensor.__neg__, torch.neg}
_NEUTRAL = {Tensor.dtype.__get__, Tensor.device.__get__, Tensor.requires_grad.__get__, Tensor.grad_fn.__get__,
            Tensor.is_leaf.__get__, Tensor.is_floating_point, Tensor.register_hook, Tensor.__repr__}


class SharedRows(Tensor):
    """A batch-shared layer output ``[T, ...]`` expanded to ``[B, T, ...]`` for per-example capture (see the module
    docstring): before the capture's hook is registered a plain tensor; after, every use is checked to compute what
    the ``[T, ...]`` tensor would have."""

    _gradtrace_shape: tuple[int, ...]
    _gradtrace_armed: bool

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        operands = [*args, *kwargs.values()]
        shared = [a for a in operands if isinstance(a, SharedRows)]
        armed = any(a._gradtrace_armed for a in shared)
        with torch._C.DisableTorchFunctionSubclass():
            if not armed or func in _NEUTRAL:
                result = func(*args, **kwargs)
                if func is Tensor.register_hook:  # the capture's own hook: from here on it is the model's tensor
                    args[0]._gradtrace_armed = True
                return result
            first = shared[0]
            rows, shape, ndim = first.shape[0], first._gradtrace_shape, first.dim()
            others = [a for a in operands if isinstance(a, Tensor) and not isinstance(a, SharedRows)]
            batched = all(a.dim() == ndim and a.shape[0] == rows for a in others)
            if func in _ARITHMETIC and others and batched:
                return func(*args, **kwargs)  # broadcasting [T, ...] against [B, T, ...] is this expansion
            if func in _INTO and others and batched and not isinstance(args[0], SharedRows):
                return func(*args, **kwargs)
            if (func in _ARITHMETIC or func in _ROWWISE) and all(a.dim() == 0 for a in others):
                logical = torch.broadcast_shapes(*(a._gradtrace_shape for a in shared))
                result = func(*args, **kwargs)  # the same computation on every row
                if result.dim() in (len(logical), len(logical) + 1):
                    return _shared(result, tuple(logical))
            if len(shared) == 1 and args and args[0] is first:
                relabelled = _relabel(func, args, kwargs, shape, ndim)
                if relabelled is not None:  # [T, ...] <-> [1, T, ...]: the same rows, another name for them
                    return _shared(first.view(first.shape), relabelled)
        name = getattr(func, "__name__", None) or getattr(getattr(func, "__self__", None), "__name__", repr(func))
        raise RuntimeError(
            f"gradtrace: a layer output computed once for the whole batch ({list(shape)}, from an input of the call's "
            f"positions without a batch dim) is captured per example as its expansion to {rows} rows, and {name!r} "
            "on it would see those rows where the model has none; only elementwise arithmetic with the batch's rows "
            "(e.g. token + position embeddings) can be captured per example this way. Pass "
            "CaptureOptions(broadcast='skip') to leave the layer out")


def _relabel(func: Any, args: tuple, kwargs: dict, shape: tuple[int, ...], ndim: int) -> tuple[int, ...] | None:
    """The shape a shared tensor of shape ``shape`` (``ndim`` dims as expanded) has after ``func`` when that only adds
    or drops a leading 1 (``unsqueeze(0)``, ``[None]``, ``view(1, T, d)``, ``squeeze(0)``), else None."""
    lead = (1, *shape) if ndim == len(shape) + 1 else None  # [T, ...] -> [1, T, ...]
    if func in (Tensor.unsqueeze, torch.unsqueeze) and lead is not None:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return lead if dim in (0, -len(lead)) else None
    if func is Tensor.__getitem__ and lead is not None:
        key = args[1] if isinstance(args[1], tuple) else (args[1],)
        rest = all(k is Ellipsis or (isinstance(k, slice) and k == slice(None)) for k in key[1:])
        return lead if key[:1] == (None,) and rest else None
    if func in (Tensor.view, Tensor.reshape, torch.reshape) and lead is not None:
        size = args[1:]
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = tuple(size[0])
        return lead if tuple(size) == lead else None
    if func in (Tensor.squeeze, torch.squeeze) and ndim == len(shape) and shape[:1] == (1,):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape[1:] if dim == 0 else None
    return None


def _shared(tensor: Tensor, shape: tuple[int, ...]) -> SharedRows:
    out = tensor.as_subclass(SharedRows)
    out._gradtrace_shape, out._gradtrace_armed = shape, True
    return out


def shared_rows(output: Tensor, rows: int) -> SharedRows:
    """``output`` (``[T, ...]``, computed once for the batch) as ``[rows, T, ...]``: an expanded view, still on the
    autograd graph (its gradient is each row's share), checked once the capture's hook is on it
    (:class:`SharedRows`)."""
    out = output.unsqueeze(0).expand(rows, *output.shape).as_subclass(SharedRows)
    out._gradtrace_shape, out._gradtrace_armed = tuple(output.shape), False
    return out


def output_tensors(output: Any) -> list[Tensor]:
    """The tensors of a forward call's output (a tensor, or a dict, tuple or list holding tensors)."""
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return [v for v in values if isinstance(v, Tensor)]
