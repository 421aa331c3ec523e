"""The dataset driver: a dataset run through a model inside a capture, one backward pass per batch.

:func:`run_capture` is what :func:`gradtrace.collect`, ``fit_curvature``, LESS features and ``gradtrace.plan``
use to turn an iterable of batches into captured per-example gradients at fixed weights: it takes each
batch's ids (an id column, a list, or content hashes), skips ids already done (resume), refuses sequences
longer than the model's context, computes one loss per example and backpropagates their sum -- by default to
the captured layers' *outputs* only (``torch.autograd.grad(loss, outputs)``), so that no weight gradient is
computed and ``param.grad`` is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..common.batches import to_device
from ..common.modules import context_limit
from ..loss.functions import LossFn, default_loss, default_loss_labels
from ..options.run import RunOptions

__all__ = ["batch_size", "run_capture"]


def batch_size(batch: Any) -> int:
    """The number of rows of a batch (the first dimension of its first tensor)."""
    tensors = batch.values() if isinstance(batch, dict) else (batch if isinstance(batch, (list, tuple)) else [batch])
    for value in tensors:
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("cannot find the batch dimension: batches must hold tensors")


def _select_rows(batch: Any, rows: list[int], size: int) -> Any:
    """Rows ``rows`` of every per-row tensor or list of a batch of ``size`` rows."""
    index = torch.tensor(rows, dtype=torch.long)

    def take(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == size:
            return value.index_select(0, index.to(value.device))
        if isinstance(value, list) and len(value) == size:
            return [value[i] for i in rows]
        return value

    if isinstance(batch, dict):
        return {k: take(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(take(v) for v in batch)
    return take(batch)


def run_capture(model: nn.Module, data: Iterable[Any], loss_fn: LossFn | None, cap: Any,
                run: RunOptions | None = None, *, skip: set[str] | frozenset = frozenset(),
                what: str = "collect") -> int:
    """Run ``data`` through ``model`` inside capture ``cap``: one per-example loss and one backward pass per
    batch, to the captured layers' outputs only (no weight gradients) unless ``run.weight_grads``.

    A ``loss_fn`` with a ``capture_info(batch) -> dict`` method says what the capture cannot see in its forward call
    (:meth:`Capture.annotate`'s keywords: e.g. ``row_examples`` for examples of several rows, as
    :class:`gradtrace.loss.preference.DPOLoss` has); it still returns one loss per example of the batch.

    Returns the number of examples processed. Examples whose id is in ``skip`` are not computed. The model's
    mode and ``param.grad`` are restored afterwards. ``run.progress``: show a bar over the batches (``run.total``
    of them when the data has no ``len``; without either it shows the rate only), labelled ``what`` or, when a
    string, by it; it also shows the examples done and their rate.
    """
    run = run if run is not None else RunOptions()
    ids = run.ids
    device, id_key, weight_grads, eval_mode = run.device, run.id_key, run.weight_grads, run.eval_mode
    progress, total = run.progress, run.total
    device = torch.device(device) if device is not None else None
    was_training = model.training
    if eval_mode:
        model.eval()
    id_list = list(ids) if ids is not None else None
    consumed = seen = 0
    limit = context_limit(model)
    cap.track_outputs = not weight_grads
    saved_grads = {n: p.grad for n, p in model.named_parameters()} if weight_grads else None
    bar = _progress(data, progress, total, progress if isinstance(progress, str) else what)
    try:
        with cap:
            for batch in bar:
                size = batch_size(batch)
                raw_ids = None  # as given: the capture refuses ids of two types (1 and "1") before str()
                if isinstance(batch, dict) and id_key in batch:
                    raw_ids = list(batch[id_key].tolist() if isinstance(batch[id_key], Tensor) else batch[id_key])
                    batch = {k: v for k, v in batch.items() if k != id_key}
                elif id_list is not None:
                    raw_ids = id_list[consumed:consumed + size]
                    if len(raw_ids) < size:
                        raise ValueError(f"{what}(): {len(id_list)} ids given but the data has more examples")
                    consumed += size
                batch_ids = None if raw_ids is None else [str(i) for i in raw_ids]
                if skip and batch_ids is not None:  # resume: skip examples already done
                    keep = [i for i, ident in enumerate(batch_ids) if ident not in skip]
                    if not keep:
                        continue
                    if len(keep) < size:
                        batch, batch_ids = _select_rows(batch, keep, size), [batch_ids[i] for i in keep]
                        raw_ids = [raw_ids[i] for i in keep]
                        size = len(keep)
                if limit is not None and isinstance(batch, dict) and isinstance(batch.get("input_ids"), Tensor):
                    length = batch["input_ids"].shape[-1]
                    if length > limit:
                        raise ValueError(f"{what}(): a batch has sequences of {length} tokens but the model's "
                                         f"context is {limit}; truncate or split them")
                batch = to_device(batch, device)
                fn = loss_fn or default_loss(batch, single_backward=True)
                info: dict[str, Any] = {} if raw_ids is None else {"ids": raw_ids}
                if loss_fn is None:  # the capture learns each example's target count (zero ones are warned about)
                    labels = default_loss_labels(batch)
                    if labels is not None:
                        info["labels"] = labels if getattr(cap, "causal_lm", True) else _shift_left(labels)
                elif hasattr(loss_fn, "capture_info"):  # a loss whose forward call the batch does not show
                    info.update(loss_fn.capture_info(batch))
                if info:
                    cap.annotate(**info)
                losses = fn(model, batch)
                if losses.dim() != 1 or losses.shape[0] != size:
                    raise ValueError(f"loss_fn must return one loss per example ([{size}]), got "
                                     f"{tuple(losses.shape)}")
                total_loss = losses.sum()
                if weight_grads:
                    total_loss.backward()
                else:
                    outputs = cap.pop_outputs()
                    if not outputs:
                        raise RuntimeError(f"{what}(): no captured layer took part in the loss")
                    torch.autograd.grad(total_loss, outputs, allow_unused=True)
                seen += size
                if hasattr(bar, "set_postfix"):
                    _show_examples(bar, seen)
    finally:
        if hasattr(bar, "close"):
            bar.close()
        if saved_grads is not None:
            for n, p in model.named_parameters():
                p.grad = saved_grads[n]
        model.train(was_training)
    if id_list is not None and consumed < len(id_list) and not skip:
        raise ValueError(f"{what}(): {len(id_list)} ids given for {consumed} examples")
    return seen


def _shift_left(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """``[B, T]`` labels moved one position left (position ``t`` holds what the logits at ``t`` predict)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def _show_examples(bar: Any, seen: int) -> None:
    """The bar's postfix: examples done and examples per second (the bar itself counts batches)."""
    elapsed = bar.format_dict.get("elapsed") or 0.0
    rate = f"{seen / elapsed:,.1f}/s" if elapsed > 0 else "?/s"
    bar.set_postfix_str(f"{seen:,} examples, {rate}")


def _progress(data: Iterable[Any], enabled: bool | str, total: int | None, what: str = "collect") -> Iterable[Any]:
    """A progress bar over ``data`` labelled ``what`` (total: ``total`` or ``len(data)``; neither: a rate only):
    tqdm on a terminal, plain lines in a log (:func:`gradtrace.common.progress.progress_bar`)."""
    if not enabled:
        return data
    from ..common.progress import progress_bar

    if total is None:
        with contextlib.suppress(TypeError):
            total = len(data)  # type: ignore[arg-type]
    return progress_bar(data, total=total, desc=what, unit="batch")
