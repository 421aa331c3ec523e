"""Recording a Hugging Face ``Trainer`` run for replay and metagradients (the same run directory as
:class:`gradtrace.replay.RunRecorder` writes)::

    from gradtrace.replay.hf import causal_lm_loss, record_trainer
    trainer = Trainer(model, args, train_dataset=dataset, data_collator=collator)
    record_trainer(trainer, "runs/r1")           # ids: each example's row index in the training dataset
    trainer.train()
    run = load_run("runs/r1")
    batches = lambda ids: collator([dataset[i] for i in ids])
    metagradients(run, model, causal_lm_loss, batches, queries, query_loss_fn)

What is recorded: the optimizer the Trainer built (``adamw_torch``, or the default ``adamw_torch_fused``, replayed
through the same kernels; its decay / no-decay parameter groups), the learning rate of
every step (any ``lr_scheduler_type``), ``max_grad_norm``, ``gradient_accumulation_steps`` and the reduction: a
model that takes ``num_items_in_batch`` (GPT-2, Llama, ...) divides the summed token loss of each micro-batch by
the loss tokens of the whole optimizer step (``Reduction("token_mean", num_items_in_batch=True,
divide_by_accumulation=False)``); other models average over the micro-batch's tokens and the Trainer divides by
the accumulation steps. Example ids reach the recorder through a wrapped data collator and a ``compute_loss``
wrapper, both undone when training ends.

Refused: a custom ``compute_loss_func``, label smoothing, several GPUs in one process, and (through the recorder)
dropout: build the model with its dropout probabilities at 0. Every epoch must have a multiple of
``gradient_accumulation_steps`` batches (a shorter last step is not replayed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from transformers import TrainerCallback

from ..integrations.trainer_ids import ID_KEY, prepare_ids
from .record import RunRecorder
from .spec import Reduction, ReplayError

__all__ = ["ReplayCallback", "causal_lm_loss", "record_trainer", "trainer_reduction"]


def trainer_reduction(trainer: Any) -> Reduction:
    """The reduction a ``Trainer`` applies to its model's loss.

    Raises:
        ReplayError: a ``compute_loss_func``, label smoothing or ``n_gpu > 1`` (not replayed).
    """
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ReplayError("record_trainer: a custom compute_loss_func is not replayed")
    if trainer.args.label_smoothing_factor:
        raise ReplayError("record_trainer: label smoothing is not replayed")
    if trainer.args.n_gpu > 1:
        raise ReplayError("record_trainer: several GPUs in one process (DataParallel) are not replayed")
    if getattr(trainer, "model_accepts_loss_kwargs", False):
        return Reduction("token_mean", num_items_in_batch=True, divide_by_accumulation=False)
    return Reduction("token_mean", divide_by_accumulation=True)


def causal_lm_loss(forward: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """A causal LM's per-example summed token losses and loss-token counts, as the Trainer's model computes them.

    Args:
        forward: the model (or the replay's functional model).
        batch: ``input_ids``, ``labels`` (-100 where no loss), optionally ``attention_mask``.

    Returns:
        ``(losses [B], counts [B])``: ``sum_t CE(logits_t, labels_{t+1})`` in float32, and the number of such
        tokens.
    """
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    logits = forward(**inputs).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    return tokens.sum(-1), (labels != -100).sum(-1)


class ReplayCallback(TrainerCallback):
    """Trainer callback feeding a :class:`RunRecorder` (made by :func:`record_trainer`)."""

    def __init__(self, trainer: Any, run_dir: str | Path, ids: str = "index") -> None:
        self.trainer, self.run_dir, self.reduction = trainer, Path(run_dir), trainer_reduction(trainer)
        self.recorder: RunRecorder | None = None
        self._micro: list[list[Any]] = []
        self._undo_ids = prepare_ids(trainer, ids)
        original = trainer.compute_loss

        def compute_loss(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            ids_ = inputs.pop(ID_KEY, None)
            if ids_ is not None and model.training:
                self._micro.append(list(ids_))
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        self._original = original

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Make the recorder: initial weights, optimizer groups, clipping, accumulation, reduction."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.recorder = RunRecorder(self.run_dir, model, inner, scheduler=lr_scheduler,
                                    grad_clip=args.max_grad_norm if args.max_grad_norm else None,
                                    accumulation=args.gradient_accumulation_steps, reduction=self.reduction)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the optimizer step just taken with the ids of its micro-batches."""
        micro, self._micro = self._micro, []
        if self.recorder is None:
            raise ReplayError("record_trainer: a step ended before training began")
        self.recorder.step(micro)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Save the final weights and manifest; undo the collator and ``compute_loss`` wrappers."""
        self.trainer.compute_loss = self._original
        self._undo_ids()
        if self.recorder is not None:
            self.recorder.finish(model)


def record_trainer(trainer: Any, run_dir: str | Path, *, ids: str = "index") -> ReplayCallback:
    """Record ``trainer``'s next ``train()`` into ``run_dir``.

    Args:
        trainer: a ``transformers.Trainer`` (its dataloader in the main process: ``dataloader_num_workers=0``).
        run_dir: the run directory.
        ids: ``"index"`` (row index in the training dataset) or the name of an id column.

    Returns:
        the callback, already added to the trainer.

    Raises:
        ReplayError: a loss the replay cannot reproduce (see :func:`trainer_reduction`).
    """
    if trainer.args.dataloader_num_workers:
        raise ReplayError("record_trainer: needs dataloader_num_workers=0 (ids travel through the collator)")
    callback = ReplayCallback(trainer, run_dir, ids)
    trainer.add_callback(callback)
    return callback
