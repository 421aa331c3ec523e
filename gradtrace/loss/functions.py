"""Per-example losses: the loss functions of :func:`gradtrace.collect` (``loss_fn(model, batch) -> [B]``, typed
:data:`LossFn`) and the :class:`LossConvention` that says which loss a captured gradient is the gradient of.

This module sits on the bottom floor of the package (it imports nothing from gradtrace), so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MODEL_KEYS", "LossConvention", "LossFn", "causal_lm_loss", "classification_loss", "default_loss_labels",
           "regression_loss", "lm_labels", "row_chunk", "token_cross_entropy", "token_log_probs"]

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")
"""The keys of a tokenized batch that a language model's forward takes (the others are labels, ids, ...)."""

LossFn = Callable[[nn.Module, Any], Tensor]
"""A per-example loss: ``loss_fn(model, batch) -> [B]``, one loss per row of the batch."""


@dataclass(frozen=True)
class LossConvention:
    """How captured gradients relate to the training loop's loss.

    reduction: how the loop combined examples into the loss it called ``backward()`` on:
        ``"mean"`` (mean over the rows of each forward call), ``"sum"``, or ``"token_mean"``
        (sum over all target tokens of the batch divided by their count, or by the
        ``num_items_in_batch`` the Hugging Face Trainer passes).
    example_loss: the loss each captured gradient is the gradient of: ``"sum"`` over the example's
        target tokens (default) or the per-token ``"mean"``.
    """

    reduction: str = "mean"
    example_loss: str = "sum"

    def to_dict(self) -> dict[str, str]:
        return {"reduction": self.reduction, "example_loss": self.example_loss}


# autograd nodes that keep neither their output nor a view of it for their own backward: logits made by one of
# these (seen through views) can be overwritten by their gradient without breaking the rest of the backward pass
_KEEPS_NO_OUTPUT = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "ToCopyBackward0", "MulBackward0",
                              "DivBackward0", "AddBackward0", "SubBackward0"})
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SliceBackward0",
                    "TBackward0", "TransposeBackward0", "PermuteBackward0"})


_CONSUMABLE = frozenset({torch.float32, torch.bfloat16, torch.float16})


def _overwritable(logits: Tensor) -> bool:
    """Whether ``logits`` (float32, bfloat16 or float16, contiguous) come from an op whose backward does not read
    them."""
    if logits.dtype not in _CONSUMABLE or not logits.is_contiguous():
        return False
    node = logits.grad_fn
    while node is not None and node.name() in _VIEWS:
        node = node.next_functions[0][0]
    return node is not None and node.name() in _KEEPS_NO_OUTPUT


def row_chunk(width: int) -> int:
    """Rows per block of a pass over ``[N, width]`` logits: about 2M entries (8 MB in float32), which stay in cache;
    the most float32 memory such a pass holds beyond its ``[N]`` results."""
    return max(1, (1 << 21) // max(1, width))


def _row_logsumexp(logits: Tensor, chunk: int) -> Tensor:
    """``[N]`` float32 log-sum-exp of each row of ``[N, V]`` logits, one ``[chunk, V]`` float32 block at a time.

    The sum runs in float32 whatever the logits' dtype: in bfloat16 (8 significant bits) a sum of ``V`` exponentials
    loses every term below ``2^-9`` of the running total, so for ``V`` = 128k the loss would be off by whole nats; in
    float32 its relative error is at most about ``V * eps32`` (``1.5e-2`` worst case at 128k, ``~sqrt(V) * eps32``
    typically) and the loss is accurate to that in absolute terms."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk):
        lse[start:start + chunk] = torch.logsumexp(logits[start:start + chunk].float(), dim=1)
    return lse


class _TokenCrossEntropy(torch.autograd.Function):
    """Cross-entropy per row of ``[N, V]`` logits, computed in row chunks that stay in cache.

    Forward reads the logits once (a log-sum-exp per row); backward writes ``softmax - onehot`` once.
    ``F.cross_entropy`` instead materializes ``log_softmax`` (an extra ``[N, V]`` write and read each way),
    which for a large vocabulary costs as much as the model's smaller layers. With ``consume``, backward writes
    the gradient into the logits' own memory instead of a new ``[N, V]`` buffer -- when :func:`_overwritable`
    says no other backward step reads the logits (the output of a matrix product, as a language model's head
    makes them); otherwise it quietly uses a new buffer (same result).

    Precision: the log-sum-exp, the picked logit and ``softmax - onehot`` are computed in float32 for every dtype
    (see :func:`_row_logsumexp`; the loss ``lse - picked`` cancels two numbers of size ``~log V + max logit``, so both
    must be float32 for the difference to be). For float32 logits every step runs in place in the output, as
    always. For bfloat16/float16 logits the gradient is written in their dtype (autograd wants that dtype): each row
    block is computed in one reused ``[chunk, V]`` float32 buffer and rounded once into it, the same values as a
    float32 ``[N, V]`` gradient cast at the end, without that buffer (``N * V * 4`` bytes: 4 GiB at 8k tokens and
    a 128k vocabulary).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, chunk: int, consume: bool) -> Tensor:
        lse = _row_logsumexp(logits, chunk)
        valid = targets != ignore_index
        safe = targets.clamp(min=0)
        picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()  # exact: a bf16/fp16 value is a float32 one
        ctx.save_for_backward(logits, lse, safe, valid)
        ctx.chunk = chunk
        ctx.consume = consume and _overwritable(logits)
        return torch.where(valid, lse - picked, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, lse, safe, valid = ctx.saved_tensors
        if torch.is_grad_enabled():  # a double backward (create_graph, metagradients): a differentiable gradient
            return _differentiable_grad(logits, safe, valid, grad), None, None, None, None
        weight = torch.where(valid, grad.float(), torch.zeros_like(lse))
        # consumed: the logits are read row block by row block just before the block is overwritten
        out = logits.detach() if ctx.consume else torch.empty_like(logits)
        in_place = out.dtype == torch.float32
        buffer = None if in_place else torch.empty(min(ctx.chunk, logits.shape[0]), logits.shape[1],
                                                   dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            # softmax * weight, minus weight at the target, in float32: in the output (float32) or the buffer
            block = out[start:stop] if in_place else buffer[:out[start:stop].shape[0]]
            torch.sub(logits[start:stop], lse[start:stop, None], out=block)
            block.exp_().mul_(weight[start:stop, None])
            block.scatter_add_(1, safe[start:stop, None], -weight[start:stop, None])
            if not in_place:
                out[start:stop].copy_(block)  # the one rounding to the logits' dtype
        # a row that is no target gets exactly zero, even where its logits are NaN/inf (softmax * 0 is NaN there):
        # NaN at padding would otherwise flow back into the real tokens through masked attention
        silent = ~valid & ~torch.isfinite(lse)
        if bool(silent.any()):
            out[silent] = 0
        return out, None, None, None, None


def _differentiable_grad(logits: Tensor, safe: Tensor, valid: Tensor, grad: Tensor) -> Tensor:
    """``(softmax - onehot) * grad`` per row through differentiable ops, for a backward that builds a graph (the
    chunked in-place path writes with ``out=``, which autograd cannot differentiate); rows that are no target get 0."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
    weight = torch.where(valid, grad.to(dtype), torch.zeros_like(grad, dtype=dtype))
    probs = torch.softmax(logits.to(dtype), dim=1)
    onehot = torch.nn.functional.one_hot(safe, logits.shape[1]).to(probs.dtype)
    out = (probs - onehot) * weight[:, None]
    return torch.where(valid[:, None], out, torch.zeros_like(out)).to(logits.dtype)


def token_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, *,
                        consume_logits: bool = False) -> Tensor:
    """``[N]`` cross-entropy of ``[N, V]`` logits against ``[N]`` targets (0 where ``ignore_index``).

    Equal to ``F.cross_entropy(..., reduction="none")`` with half its memory traffic (see
    :class:`_TokenCrossEntropy`); accumulates in float32 by row blocks, so bfloat16/float16 logits get no float32
    ``[N, V]`` copy (their gradient is written in their dtype).

    ``consume_logits=True`` lets the backward pass overwrite the logits with their gradient (float32, bfloat16 or
    float16 logits made by a matrix product; others get a new buffer): one ``[N, V]`` buffer less, and its
    first-touch page faults.
    Only for logits nobody reads after the backward pass, in a graph differentiated once (a second backward
    through it raises autograd's in-place error).
    """
    return _TokenCrossEntropy.apply(logits, targets, ignore_index, row_chunk(logits.shape[1]), consume_logits)


def token_log_probs(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """``[N]`` float32 ``log_softmax(logits)[n, targets[n]]`` of ``[N, V]`` logits (0 where ``ignore_index``), without
    gradient: the log-sum-exp runs in float32 over row blocks (:func:`_row_logsumexp`), so the logits are never
    copied to float32 whole -- for checks and weights read next to a live graph."""
    with torch.no_grad():
        lse = _row_logsumexp(logits, row_chunk(logits.shape[1]))
        picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1).float()
        return torch.where(targets != ignore_index, picked - lse, torch.zeros_like(lse))


def lm_labels(batch: dict[str, Tensor], ignore_index: int = -100) -> Tensor:
    """``batch["labels"]``, or the input ids with padding (``attention_mask == 0``) ignored."""
    if batch.get("labels") is not None:
        return batch["labels"]
    labels = batch["input_ids"].clone()
    if batch.get("attention_mask") is not None:
        labels = labels.masked_fill(batch["attention_mask"] == 0, ignore_index)
    return labels


def causal_lm_loss(model: nn.Module, batch: dict[str, Any], *, mean: bool = False,
                   ignore_index: int = -100, consume_logits: bool = False) -> Tensor:
    """Per-row next-token loss of a causal LM: the sum over target tokens (``mean=True``: their mean).

    ``batch`` holds ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels``
    (``ignore_index`` = not a target; default: every non-padding token after the first). ``consume_logits``:
    see :func:`token_cross_entropy` (the logits here never leave this function).
    """
    labels = lm_labels(batch, ignore_index)
    kwargs = {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}
    logits = model(**kwargs).logits  # [B, T, V]
    labels = labels.to(logits.device)
    # logits at t predict labels[t + 1]; shifting the labels (not the logits) avoids copying [B, T, V]
    shift_labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)
    per_token = token_cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index,
                                    consume_logits=consume_logits).view(labels.shape)
    total = per_token.sum(1)
    if mean:
        total = total / (shift_labels != ignore_index).sum(1).clamp(min=1)
    return total


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Per-example cross-entropy for ``(inputs, targets)`` batches or dicts with ``labels``."""
    if isinstance(batch, dict):
        targets = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "id")})
        logits = getattr(logits, "logits", logits)
    else:
        inputs, targets = batch
        logits = model(inputs)
    return F.cross_entropy(logits, targets, reduction="none")


def regression_loss(model: nn.Module, batch: Any) -> Tensor:
    """Per-example squared error ``0.5 * |f(x) - y|^2`` for ``(inputs, targets)`` batches or dicts with ``labels``."""
    if isinstance(batch, dict):
        targets = batch["labels"]
        outputs = model(**{k: v for k, v in batch.items() if k not in ("labels", "id")})
    else:
        inputs, targets = batch
        outputs = model(inputs)
    outputs = getattr(outputs, "logits", outputs)
    diff = (outputs - targets.to(outputs.dtype)).reshape(outputs.shape[0], -1)
    return 0.5 * diff.pow(2).sum(1)


def _causal_lm_loss_once(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    return causal_lm_loss(model, batch, consume_logits=True)


def default_loss_labels(batch: Any, ignore_index: int = -100) -> Tensor | None:
    """``[B, T]`` token labels of the loss :func:`default_loss` picks for ``batch`` (``labels[t]`` is predicted
    from the tokens before ``t``), or None when that loss is not the causal LM loss."""
    if default_loss(batch) is not causal_lm_loss:
        return None
    return lm_labels(batch, ignore_index)


def default_loss(batch: Any, *, single_backward: bool = False):
    """The loss :func:`gradtrace.collect` uses when none is given, judged from the batch's form: causal LM
    for dicts with ``input_ids`` (and token-level or no ``labels``), classification otherwise.
    ``single_backward``: the caller differentiates each loss once (the causal LM loss may then reuse the logits'
    memory for their gradient)."""
    if isinstance(batch, dict) and "input_ids" in batch:
        labels = batch.get("labels")
        if labels is None or labels.dim() == 2:
            return _causal_lm_loss_once if single_backward else causal_lm_loss
    return classification_loss
