"""Recording a Hugging Face ``Trainer`` run for replay and metagradients (the same run directory as
:class:`gradtrace.replay.RunRecorder` writes)::

    from gradtrace.replay.examples import load_examples
    from gradtrace.replay.hf import record_trainer, run_loss
    trainer = Trainer(model, args, train_dataset=dataset, data_collator=collator, processing_class=tokenizer)
    record_trainer(trainer, "runs/r1")           # ids: each example's row index in the training dataset
    trainer.train()
    run = load_run("runs/r1")
    batches = load_examples("runs/r1")           # or: lambda ids: collator([dataset[i] for i in ids])
    metagradients(run, model, run_loss("runs/r1"), batches, queries, query_loss_fn)

``run_loss(run_dir)`` is :func:`causal_lm_loss` counting the labels of ``num_items_in_batch`` as the Trainer did
(``trainer.json``): every label for GPT-2 (``GPT2LMHeadModel`` has no causal-LM ``loss_type``), the shifted ones for
``*ForCausalLM`` models. With the wrong count every gradient is off by the same factor, which clipping hides while it
clips.

What is recorded: the optimizer the Trainer built (``adamw_torch``, or the default ``adamw_torch_fused``, replayed
through the same kernels; its decay / no-decay parameter groups), the learning rate of
every step (any ``lr_scheduler_type``), ``max_grad_norm``, ``gradient_accumulation_steps`` and the reduction: a
model that takes ``num_items_in_batch`` (GPT-2, Llama, ...) divides the summed token loss of each micro-batch by
the loss tokens of the whole optimizer step (``Reduction("token_mean", num_items_in_batch=True,
divide_by_accumulation=False)``); other models average over the micro-batch's tokens and the Trainer divides by
the accumulation steps. Example ids reach the recorder through a wrapped data collator and a ``compute_loss``
wrapper, both undone when training ends.

Self-contained run directories: besides the run itself, the recorder saves what rebuilds it without the user's
code (``examples=True``, the default): the model's configuration with its architecture (``model/config.json``), the
Trainer's tokenizer (its ``processing_class``, beside the configuration: ``model/`` is a model directory without
weights) and the training examples as the data collator gave them (``examples.safetensors`` + ``examples.json``, read
back by :func:`gradtrace.replay.examples.load_examples` as the replay's ``batches(ids)``, bit for bit);
``gradtrace metagrad RUN_DIR QUERIES`` needs them.

Refused: a custom ``compute_loss_func``, label smoothing, several GPUs in one process, and (through the recorder)
dropout: build the model with its dropout probabilities at 0. Every epoch must have a multiple of
``gradient_accumulation_steps`` batches (a shorter last step is not replayed).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase, TrainerCallback

from ..integrations.trainer_ids import ID_KEY, prepare_ids
from .examples import ExampleRecorder
from .record import RunRecorder
from .spec import Reduction, ReplayError

__all__ = ["ReplayCallback", "causal_lm_loss", "label_counting", "record_trainer", "run_loss", "save_model_files",
           "trainer_reduction"]

TRAINER_FILE = "trainer.json"
"""What of the Trainer's loss the replay's loss must follow: ``{"label_counts": "shifted" | "all"}``."""


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


def causal_lm_loss(forward: Any, batch: dict[str, Tensor], *, dtype: torch.dtype | None = torch.float32,
                   counts: Literal["shifted", "all"] = "shifted") -> tuple[Tensor, Tensor]:
    """A causal LM's per-example summed token losses and loss-token counts, as the Trainer's model computes them.

    Args:
        forward: the model (or the replay's functional model).
        batch: ``input_ids``, ``labels`` (-100 where no loss), optionally ``attention_mask``.
        dtype: the dtype the logits are cast to (float32, as the Trainer's models do; None: the model's own, for a
            float64 replay: ``functools.partial(causal_lm_loss, dtype=None)``).
        counts: which labels the token counts count: ``"shifted"`` (``labels[:, 1:] != -100``, the tokens in the
            loss) or ``"all"`` (``labels != -100``, the first position too), as the Trainer counted its
            ``num_items_in_batch`` (:func:`run_loss` reads which from the run directory).

    Returns:
        ``(losses [B], counts [B])``: ``sum_t CE(logits_t, labels_{t+1})`` in ``dtype``, and the labels counted.
    """
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    logits = forward(**inputs).logits[:, :-1]
    logits = logits if dtype is None else logits.to(dtype)
    labels = batch["labels"][:, 1:]
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    counted = labels if counts == "shifted" else batch["labels"]
    return tokens.sum(-1), (counted != -100).sum(-1)


def label_counting(trainer: Any) -> Literal["shifted", "all"]:
    """How ``trainer`` counts the labels of ``num_items_in_batch``: ``"shifted"`` (``labels[..., 1:]``, for a model
    whose ``loss_type`` is the causal LM loss: ``LlamaForCausalLM``, ...) or ``"all"`` (every label, the first
    position too: GPT-2's ``GPT2LMHeadModel``, whose class name gives no ``loss_type``, and Trainers before the
    shifted count). The model still divides its summed shifted token losses by that count."""
    return "shifted" if getattr(trainer, "_loss_shifts_labels", False) else "all"


def run_loss(run_dir: str | Path, *, dtype: torch.dtype | None = torch.float32) -> Any:
    """:func:`causal_lm_loss` as the recorded Trainer computed it: its label counting read from
    ``run_dir/trainer.json`` (``"shifted"`` when absent); ``dtype`` as there."""
    path = Path(run_dir) / TRAINER_FILE
    counting = json.loads(path.read_text(encoding="utf-8")).get("label_counts", "shifted") if path.exists() \
        else "shifted"
    return functools.partial(causal_lm_loss, dtype=dtype, counts=counting)


class ReplayCallback(TrainerCallback):
    """Trainer callback feeding a :class:`RunRecorder` (made by :func:`record_trainer`)."""

    def __init__(self, trainer: Any, run_dir: str | Path, ids: str = "index", examples: bool = True,
                 keep_states: int | None = None) -> None:
        self.trainer, self.run_dir, self.reduction = trainer, Path(run_dir), trainer_reduction(trainer)
        self.keep_states = keep_states
        self.recorder: RunRecorder | None = None
        self.examples = ExampleRecorder() if examples else None
        self._micro: list[list[Any]] = []
        self._undo_ids = prepare_ids(trainer, ids)
        original = trainer.compute_loss

        def compute_loss(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            ids_ = inputs.pop(ID_KEY, None)
            if ids_ is not None and model.training:
                self._micro.append(list(ids_))
                if self.examples is not None:
                    self.examples.add(ids_, inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        self._original = original

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Make the recorder: initial weights, optimizer groups, clipping, accumulation, reduction."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.recorder = RunRecorder(self.run_dir, model, inner, scheduler=lr_scheduler,
                                    grad_clip=args.max_grad_norm if args.max_grad_norm else None,
                                    accumulation=args.gradient_accumulation_steps, reduction=self.reduction,
                                    keep_states=self.keep_states)
        (self.run_dir / TRAINER_FILE).write_text(json.dumps({"label_counts": label_counting(self.trainer)}),
                                                 encoding="utf-8")
        if self.examples is not None:
            save_model_files(self.trainer, self.run_dir)

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
            if self.examples is not None:
                self.examples.save(self.run_dir)
            self.recorder.finish(model)


def save_model_files(trainer: Any, run_dir: Path) -> None:
    """Save the model's configuration (with its architecture) and the Trainer's tokenizer (its ``processing_class``,
    when it is one) in ``run_dir/model``: a model directory without weights, as the library's loaders read one."""
    model = trainer.model
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(run_dir / "model")
    tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer.save_pretrained(run_dir / "model")


def record_trainer(trainer: Any, run_dir: str | Path, *, ids: str = "index", examples: bool = True,
                   keep_states: int | None = None) -> ReplayCallback:
    """Record ``trainer``'s next ``train()`` into ``run_dir``.

    Args:
        trainer: a ``transformers.Trainer`` (its dataloader in the main process: ``dataloader_num_workers=0``).
        run_dir: the run directory.
        ids: ``"index"`` (row index in the training dataset) or the name of an id column.
        examples: also save the model's configuration, the tokenizer and every training example as the collator
            gave it (what ``gradtrace metagrad`` rebuilds the run from; see the module docstring). False for a
            collator whose batches cannot be saved (tensors of more than 2 dimensions, packed sequences).
        keep_states: also write the optimizer state before every ``keep_states``-th optimizer step
            (:class:`RunRecorder`), so that a truncated metagradient pass (``gradtrace metagrad --start-step K``)
            replays from the latest one instead of from the first step; None: none.

    Returns:
        the callback, already added to the trainer.

    Raises:
        ReplayError: a loss the replay cannot reproduce (see :func:`trainer_reduction`).
    """
    if trainer.args.dataloader_num_workers:
        raise ReplayError("record_trainer: needs dataloader_num_workers=0 (ids travel through the collator)")
    callback = ReplayCallback(trainer, run_dir, ids, examples, keep_states)
    trainer.add_callback(callback)
    return callback
