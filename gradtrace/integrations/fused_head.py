"""TRL's fused LM head, unfused while gradients of the output embedding are captured.

TRL's trainers patch the model so that ``model(..., labels=..., fused_lm_head=True)`` applies the LM head
weight *functionally*, in tiles, and returns per-token log-probabilities instead of logits
(``trl.trainer.utils.add_fused_lm_head``). The LM head module's hooks never fire, so its per-example
gradient -- and, with tied embeddings, the output half of the embedding's -- cannot be captured.

:class:`UnfusedLMHead` hooks the root model: a forward pre-hook turns such a call into a plain forward
(without labels, so the model computes no loss of its own), which runs the LM head module, and a
forward hook computes the fields TRL reads from the logits (``loss``, ``log_probs``, ``label_mask`` and,
without gradient, ``entropy``, ``is_top1``, ``log_sum_sq_probs``, ``mean_logits``). The values are those
of the fused head (with GRPO's sampling temperature ``T``, of ``logits / T``, as TRL scores them); the logits
are materialized, as capturing the LM head needs their gradient anyway, but
nothing else of their size is: the fields are computed in float32 over row blocks of the logits, and the
gradient of ``log_probs`` is written in the logits' dtype (:func:`~gradtrace.loss.token_cross_entropy`).
Only used when a captured parameter belongs to the output embedding (full fine-tuning); with LoRA the
frozen head stays fused.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ..loss.functions import row_chunk, token_cross_entropy

__all__ = ["UnfusedLMHead", "captures_output_embedding"]


def _base_model(model: nn.Module) -> nn.Module:
    from ..common.modules import unwrap

    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def captures_output_embedding(model: nn.Module, capture: Any) -> bool:
    """Whether ``capture`` covers a parameter of the model's output embedding (LM head)."""
    base = _base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return False
    captured = {id(getattr(h.module, role)) for h in capture.handlers for role in h.params}
    return any(id(p) in captured for p in head.parameters())


def _fused_settings(model: nn.Module) -> dict[str, Any]:
    """The closure variables of TRL's patched forward (temperature, ...); empty if it is not patched."""
    forward = getattr(_base_model(model), "forward", None)
    func = getattr(forward, "__func__", None)
    if func is None or func.__closure__ is None:
        return {}
    try:
        return dict(inspect.getclosurevars(func).nonlocals)
    except (TypeError, ValueError):  # pragma: no cover - unusual callables
        return {}


def _row_statistics(flat: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of ``[N, V]`` logits, without gradient: the entropy of ``p = softmax``, ``log sum_v p_v^2``, the mean
    logit (float32, ``[N]`` each) and the top-1 label (``[N]``), one ``[chunk, V]`` float32 block at a time."""
    count, width = flat.shape
    entropy, log_sum_sq, mean = (torch.empty(count, dtype=torch.float32, device=flat.device) for _ in range(3))
    top1 = torch.empty(count, dtype=torch.long, device=flat.device)
    chunk = row_chunk(width)
    with torch.no_grad():
        for start in range(0, count, chunk):
            rows = slice(start, start + chunk)
            block = flat[rows].to(torch.float32, copy=True)  # [chunk, V]; a copy: changed in place below
            mean[rows] = block.mean(-1)
            top1[rows] = block.argmax(-1)
            block -= torch.logsumexp(block, dim=-1, keepdim=True)  # log-softmax
            log_sum_sq[rows] = torch.logsumexp(2 * block, dim=-1)
            entropy[rows] = -(block.exp() * block).sum(-1)
    return entropy, log_sum_sq, mean, top1


def fused_outputs(logits: Tensor, labels: Tensor, num_items: Tensor | float | None, output_class: type) -> Any:
    """TRL's fused-head fields from full logits ``[B, T, V]`` and unshifted ``labels`` ``[B, T]``.

    No float32 ``[B, T, V]`` tensor is made (see the module docstring): the labels are shifted instead of the logits
    (position ``t`` predicts ``labels[t + 1]``; the last position predicts nothing), so contiguous logits are read
    as the ``[B * T, V]`` view they are."""
    batch, length, vocab = logits.shape
    targets = labels[:, 1:].to(logits.device)  # [B, T-1]
    mask = targets != -100
    shifted = torch.cat([targets, targets.new_full((batch, 1), -100)], dim=1).reshape(-1).long()  # [B * T]
    flat = logits.reshape(-1, vocab)  # [B * T, V]
    per_token = token_cross_entropy(flat, shifted)  # [B * T] float32, 0 where ignored
    log_probs = (-per_token).view(batch, length)[:, :-1].masked_fill(~mask, 0.0)
    entropy, log_sum_sq, mean_logits, top1 = (x.view(batch, length)[:, :-1] for x in _row_statistics(flat))
    entropy, log_sum_sq, mean_logits = (x.masked_fill(~mask, 0.0) for x in (entropy, log_sum_sq, mean_logits))
    is_top1 = (top1 == targets) & mask
    denominator = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / denominator
    return output_class(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq,
                        mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=None)


class UnfusedLMHead:
    """Forward hooks on the root model that run ``fused_lm_head=True`` calls through the LM head module."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []
        self._stack: list[tuple[Tensor, Any] | None] = []
        self.used = False

    def install(self) -> None:
        self._handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.model.register_forward_hook(self._post, with_kwargs=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not kwargs.get("fused_lm_head"):
            self._stack.append(None)
            return None
        temperature = float(_fused_settings(module).get("temperature", 1.0))  # GRPO's sampling temperature
        if not temperature > 0.0:
            raise ValueError(f"gradtrace: the fused LM head's temperature must be positive, got {temperature}")
        kwargs = dict(kwargs)
        kwargs.pop("fused_lm_head")
        labels = kwargs.pop("labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        if labels is None or kwargs.pop("shift_labels", None) is not None:
            raise NotImplementedError("gradtrace: capturing the LM head through TRL's fused head needs unshifted "
                                      "labels; exclude the LM head (CaptureOptions(exclude=['lm_head']))")
        kwargs["use_cache"] = False
        self._stack.append((labels, num_items, temperature))
        self.used = True
        return args, kwargs

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        entry = self._stack.pop() if self._stack else None
        if entry is None:
            return None
        from trl.trainer.utils import FusedCausalLMOutput

        labels, num_items, temperature = entry
        logits = output.logits if temperature == 1.0 else output.logits / temperature  # as the fused head scores
        fields = fused_outputs(logits, labels, num_items, FusedCausalLMOutput)
        aux_loss = getattr(output, "aux_loss", None)
        if aux_loss is not None:  # MoE with router logits requested: the load-balancing loss, as the fused head adds it
            fields.aux_loss = aux_loss
            fields.loss = fields.loss + float(getattr(module.config, "router_aux_loss_coef", 0.0)) * aux_loss
        return fields
