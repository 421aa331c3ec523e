"""Hugging Face ``Trainer`` (and TRL) integration: per-example gradients captured during ``trainer.train()``.

```python
from gradtrace.integrations.hf import GradtraceCallback

callback = GradtraceCallback("runs/train", options=gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=16)),
                             ids="id")
trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])   # or trl.SFTTrainer
trainer.train()
store = callback.result()        # a GradientStore: one row per example, with step, epoch and lr
```

During ``train()`` the callback

* opens ``gradtrace.capture`` on the Trainer's model at each captured optimizer step (hooks only: plain,
  PEFT-wrapped and DDP-wrapped models alike) and closes it at the step's end, and everything at the end
  of training -- also when training raises;
* tells the capture, for every micro-batch, the loss the Trainer backpropagates (``num_items_in_batch``,
  gradient accumulation, ``average_tokens_across_devices``, the AMP grad scaler; see
  :mod:`gradtrace.integrations.trainer_loss`) and checks it once against the value ``compute_loss`` returns;
* carries each example's id from the training dataset to the capture (:mod:`.trainer_ids`);
* runs TRL's fused LM head through the LM head module when its gradient is captured (:mod:`.fused_head`);
* inside TRL's ``GRPOTrainer``, writes one row per completion: the gradient of the trainer's loss for it, scaled
  per ``loss_type``, with ids and fields tying it to its prompt and rollout (:mod:`.trl_grpo`);
* writes the rows with their step, epoch and learning rate, and records the checkpoints the Trainer saves
  in the store's manifest (:mod:`.trainer_store`).

The Trainer's callback events give no access to batches or to the loss normaliser, so the callback needs
the Trainer itself: passed in ``Trainer(callbacks=[...])`` it finds it when the Trainer finishes its
constructor; otherwise call :meth:`GradtraceCallback.attach`. Everything it changes on the Trainer (the
training dataset, the data collator, the signature columns, ``compute_loss``) is changed only inside
``train()`` and restored when ``train()`` returns or raises.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..capture import Capture
from ..options import CaptureOptions, Loss, StoreOptions
from ..options.base import option_object
from ..store import GradientStore
from .trainer_session import Session
from .trainer_store import checkpoints, segments

__all__ = ["GradtraceCallback", "checkpoints", "segments"]


class GradtraceCallback(TrainerCallback):
    """Captures per-example gradients into a gradient store while a ``transformers.Trainer`` trains.

    Args:
        store: the store directory.
        loss: the Trainer's loss (:class:`gradtrace.Loss`). By default everything is derived from the Trainer
            (``num_items_in_batch``, gradient accumulation, the AMP scaler); set ``reduction`` and ``scale`` to
            state it yourself (for a custom ``compute_loss``: the check tells you if needed). ``example_loss``: the
            loss each gradient belongs to (``"sum"`` over the example's target tokens, or their ``"mean"``).
            ``check``: on the first captured micro-batch, check that the value ``compute_loss`` returns is the sum
            of the examples' own losses (recomputed from the model's output) scaled as derived; raise if not.
        options: what is captured (:class:`gradtrace.CaptureOptions`: projection, layers, exclude, partial).
        store_options: how the store is written (:class:`gradtrace.StoreOptions`); ``shard_rows`` defaults to up
            to 4096, fewer when rows are large (at most 256 MiB of float32 per shard); ``config`` is recorded in
            the manifest with the resolved option objects (``config["gradtrace"]["options"]``).
        ids: where each example's id comes from: ``"index"`` (its row in the training dataset), the name of
            an id column, or None (a content hash of its unpadded tokens, numbered by
            :class:`gradtrace.data.ids.ContentIds` as ``gradtrace.data.load`` numbers them, anew each epoch).
        every, start_step: capture the optimizer steps ``start_step, start_step + every, ...`` (counted as the
            Trainer's ``global_step``: optimizer steps completed before the step). ``start_step`` at the last
            epoch's first step captures the gradients of the trained model.
        trajectory: keep every use of an example (rows ``f"{id}@{step}"`` with ``example`` and ``weight``
            fields, the layout DVEmb reads) instead of the first one only.
    """

    def __init__(self, store: str | Path, *, loss: Loss | None = None, options: CaptureOptions | None = None,
                 store_options: StoreOptions | None = None, ids: str | None = "index", every: int = 1,
                 start_step: int = 0, trajectory: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative integer, got {start_step!r}")
        loss = option_object(loss, Loss, "loss")
        if loss.fn is not None:
            raise ValueError("GradtraceCallback: the Trainer computes the loss; leave Loss.fn None")
        if loss.scale is not None and loss.reduction is None:
            raise ValueError("Loss.scale states the Trainer's loss together with Loss.reduction; pass both")
        store_options = option_object(store_options, StoreOptions, "store_options")
        self.loss = loss
        self.options = options = option_object(options, CaptureOptions, "options")
        self.store_options = store_options  # its dtype is decided when training starts (a resumed store's own)
        self.path = Path(store)
        self.ids = ids
        self.every = every
        self.start_step = start_step
        self.trajectory = trajectory
        self.trainer: Any = None
        self.capture: Capture | None = None
        self._session: Session | None = None

    # -- binding to the Trainer ----------------------------------------------------------------
    def attach(self, trainer: Any) -> GradtraceCallback:
        """Bind to ``trainer`` (and add this callback to it if needed); returns ``self``."""
        if self.trainer is not None and self.trainer is not trainer:
            raise ValueError("this GradtraceCallback is already attached to another Trainer; create one per Trainer")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if self.trainer is trainer:
            return self
        self.trainer = trainer
        original = trainer.train
        callback = self

        @functools.wraps(original)
        def train(*args: Any, **kwargs: Any) -> Any:
            if callback not in trainer.callback_handler.callbacks:  # removed from the Trainer since
                return original(*args, **kwargs)
            session = callback._session = Session(callback, trainer)
            try:
                return original(*args, **kwargs)
            except BaseException as err:
                session.abort(err)
                raise
            finally:
                session.restore()
                callback._session = None

        trainer.train = train
        return self

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            trainer = _trainer_in_stack(self)
            if trainer is not None:
                self.attach(trainer)

    # -- Trainer events ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._session is None:
            raise RuntimeError("gradtrace: GradtraceCallback is not attached to this Trainer: pass it in "
                               "Trainer(..., callbacks=[callback]) or call callback.attach(trainer) before train()")
        self._session.begin(args, state, model if model is not None else self.trainer.model)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.epoch_begin(state)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.step_begin(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.step_end()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.saved(args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.finish(None)

    # -- results -------------------------------------------------------------------------------
    def result(self) -> GradientStore:
        """The store written by the last ``train()`` (opened for reading)."""
        if self._session is not None:
            raise RuntimeError("training is still running: read the store after train() returns")
        return GradientStore.open(self.path)

    def report(self) -> Any:
        """The capture's report (what is captured, what is not, and why) of the last ``train()``."""
        if self.capture is None:
            raise RuntimeError("nothing was captured yet: call trainer.train() first")
        return self.capture.report()


def _trainer_in_stack(callback: GradtraceCallback, depth: int = 12) -> Any:
    """The Trainer whose constructor is calling ``on_init_end`` (it holds ``callback``), or None.

    The fallback that keeps ``Trainer(..., callbacks=[callback])`` working; :meth:`GradtraceCallback.attach` is
    the explicit path. No event hands a callback its Trainer (transformers 5.x, ``trainer_callback.py``
    ``CallbackHandler.call_event``: ``model``, ``processing_class``, ``optimizer``, ``lr_scheduler``,
    ``train_dataloader``, ``eval_dataloader`` only), and the session needs the Trainer itself: the id column must
    join the dataset, collator and signature columns before ``get_train_dataloader`` drops unused columns
    (``trainer.py`` ``_inner_training_loop``: the loader is built before ``on_train_begin``), every micro-batch's
    inputs and ``num_items_in_batch`` reach only ``Trainer.compute_loss`` (``training_step``), and the loss
    normaliser reads ``current_gradient_accumulation_steps``, ``model_accepts_loss_kwargs``,
    ``compute_loss_func`` and the accelerator (:mod:`.trainer_loss`). ``on_init_end`` is called at the end of
    ``Trainer.__init__``, whose frame (``self``) is a few frames up.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and callback in getattr(candidate.callback_handler, "callbacks", ()):
            return candidate
        frame = frame.f_back
    return None
