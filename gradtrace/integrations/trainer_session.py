"""One ``trainer.train()`` call of :class:`~gradtrace.integrations.hf.GradtraceCallback`: the Trainer patches, the
capture opened at each captured optimizer step, the store writer, the loss check and the checkpoints recorded.

Everything changed on the Trainer (``compute_loss``, the id column: :mod:`.trainer_ids`) is undone by
:meth:`Session.restore` when ``train()`` returns or raises.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..capture import Capture
from ..capture.sink import StoreWriter
from ..common.checkpoints import OPTIMIZER_NAMES_FILE
from ..common.modules import strip_wrappers, unwrap
from ..common.provenance import record_paths, relative_path
from ..common.ranks import rank_and_world as dist_rank
from ..options import with_record
from ..store.artifact import atomic_write_json
from ..store.spec import model_fingerprint
from ..store.writer import resolved_store_options
from .fused_head import UnfusedLMHead, captures_output_embedding
from .trainer_ids import ID_KEY, prepare_ids
from .trainer_loss import CallLoss, TrainerLoss, loss_ratio
from .trainer_store import CONFIG_KEY, TrainerRows, preflight, record_checkpoints
from .trl_dpo import DPOPairs, is_dpo_trainer
from .trl_grpo import GRPORollouts, is_grpo_trainer

if TYPE_CHECKING:
    from .hf import GradtraceCallback

__all__ = ["Session"]


class Session:
    """One ``trainer.train()`` call: the Trainer patches, the capture, the store writer."""

    def __init__(self, callback: GradtraceCallback, trainer: Any) -> None:
        self.cb = callback
        self.trainer = trainer
        self.undo: list[Callable[[], None]] = []
        self.capture: Capture | None = None
        self.rows: TrainerRows | None = None
        self.writer: StoreWriter | None = None
        self.loss: TrainerLoss | None = None
        self.unfused: UnfusedLMHead | None = None
        self.rollouts: GRPORollouts | None = None  # TRL's GRPOTrainer: one row per completion (.trl_grpo)
        self.pairs: DPOPairs | None = None  # TRL's DPOTrainer: one row per preference pair (.trl_dpo)
        self.model: Any = None
        self.capturing = False
        self.announced = False
        self.call_scale = 1.0
        self.epoch = 0
        self.entered = False
        self.closed = False
        self.checked = not callback.loss.check
        self.probe: dict[str, Any] | None = None
        self.lrs: list[float] = []
        self.saves: list[dict] = []
        self._lr_warned = False
        self.trainer_config: dict[str, Any] = {}
        try:
            if is_grpo_trainer(trainer):
                if callback.loss.reduction is not None or callback.loss.scale is not None:
                    raise ValueError("gradtrace: the GRPOTrainer's loss is derived from its loss_type; leave "
                                     "Loss.reduction and Loss.scale None (Loss.example_loss is honoured)")
                self.rollouts = GRPORollouts(trainer, callback.ids)
                self.undo.append(self.rollouts.install())
            else:
                if is_dpo_trainer(trainer):
                    if callback.loss.reduction is not None or callback.loss.scale is not None:
                        raise ValueError("gradtrace: the DPOTrainer's loss is each pair's DPO loss; leave "
                                         "Loss.reduction and Loss.scale None")
                    self.pairs = DPOPairs(trainer)
                if callback.ids is not None:
                    self.undo.append(prepare_ids(trainer, callback.ids))
            self._wrap_compute_loss()
        except BaseException:
            self.restore()
            raise

    # -- Trainer patches -----------------------------------------------------------------------
    def _wrap_compute_loss(self) -> None:
        trainer = self.trainer
        had_own = "compute_loss" in vars(trainer)
        previous = vars(trainer).get("compute_loss")
        original = trainer.compute_loss
        session = self

        @functools.wraps(original)
        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            ids = None
            if isinstance(inputs, MutableMapping):  # GRPO's buffered inputs serve several iterations: not popped
                ids = inputs.get(ID_KEY) if session.rollouts is not None else inputs.pop(ID_KEY, None)
            num_items = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
            session.announce(inputs, ids, num_items)
            try:
                result = original(model, inputs, *args, **kwargs)
            except BaseException:
                session.drop_probe()
                raise
            session.check_loss(result)
            return result

        trainer.compute_loss = compute_loss

        def undo() -> None:
            if had_own:
                trainer.compute_loss = previous
            else:
                vars(trainer).pop("compute_loss", None)

        self.undo.append(undo)

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()

    # -- training begins -------------------------------------------------------------------------
    def begin(self, args: Any, state: Any, model: Any) -> None:
        cb, trainer = self.cb, self.trainer
        self.model = model
        loss = TrainerLoss(trainer)  # refuses DataParallel and DeepSpeed
        self.loss = loss if cb.loss.reduction is None else None
        rank, world_size = dist_rank()
        self.trainer_config = {
            "trainer": type(trainer).__name__, "model": type(unwrap(model)).__name__,
            "ids": {"source": "content-hash" if cb.ids is None else "index" if cb.ids == "index" else "column",
                    **({"column": cb.ids} if cb.ids not in (None, "index") else {})},
            "every": cb.every, "start_step": cb.start_step, "trajectory": cb.trajectory,
            "loss": (self.rollouts.describe(cb.loss.example_loss) if self.rollouts is not None
                     else self.pairs.describe() if self.pairs is not None
                     else loss.describe() if self.loss is not None
                     else {"reduction": cb.loss.reduction, "loss_scale": _describe_scale(cb.loss.scale)}),
            "optimizer_parameters": _optimizer_parameter_names(trainer.optimizer, model),
            "checkpoints": []}
        output_dir = os.path.abspath(args.output_dir)
        self.trainer_config["output_dir"] = relative_path(output_dir, cb.path)
        # the model directory score loads by default: the output dir, where trainer.save_model() puts the final model
        storing = resolved_store_options(cb.path, cb.store_options)
        config = with_record({**record_paths({"model": output_dir}, cb.path), **(storing.config or {}),
                              CONFIG_KEY: self.trainer_config}, capture=cb.options, store=storing, loss=cb.loss)
        preflight(cb.path, rank, world_size, storing.resume, storing.overwrite)
        self.writer = StoreWriter(cb.path, replace(storing, shard_rows=storing.shard_rows or 4096, config=config),
                                  mixed_weights=True)
        self.rows = TrainerRows(self.writer, trajectory=cb.trajectory, auto_shard_rows=storing.shard_rows is None,
                                extra=self.rollouts.fields if self.rollouts is not None else None)
        auto = cb.loss.reduction is None
        causal_lm = cb.loss.causal_lm if cb.loss.causal_lm is not None else _is_causal_lm(model)
        if self.rollouts is not None:  # each completion's scale is given per call (example_scale)
            self.trainer_config["check"] = "not checked (GRPO: the scales follow the trainer's loss_type)"
        if self.pairs is not None:  # each pair's scale is given per call (example_scale)
            self.trainer_config["check"] = "not checked (DPO: the mean over the pairs of the trainer's loss)"
        default_reduction = "sum" if self.rollouts is not None or self.pairs is not None else "token_mean"
        loss = replace(cb.loss, reduction=cb.loss.reduction or default_reduction, causal_lm=causal_lm,
                       scale=(lambda: self.call_scale) if auto else (cb.loss.scale or 1.0))
        self.capture = cb.capture = Capture(model, loss, options=cb.options, callbacks=[self.rows],
                                            keep_batches=False)
        if not self.capture.handlers:
            raise ValueError(f"gradtrace: nothing in {type(unwrap(model)).__name__} can be captured per example "
                             f"(no trainable parameter of a supported layer kind):\n{self.capture.report()}")
        self.writer.on_capture_start(self.capture)  # the writer lives for the whole run, the capture per step
        self.unfused = UnfusedLMHead(model) if captures_output_embedding(model, self.capture) else None
        handle = model.register_forward_pre_hook(self._strip_ids, with_kwargs=True, prepend=True)
        self.undo.append(handle.remove)
        self.epoch = _epoch_index(state)

    # -- per call ------------------------------------------------------------------------------
    def announce(self, inputs: Any, ids: Any, num_items: Any) -> None:
        """``compute_loss`` was called: tell the capture about the forward call that follows."""
        if not (self.capturing and torch.is_grad_enabled() and self.model.training):
            return
        if self.rollouts is not None:
            self.call_scale = self.loss.grad_scaler_scale()
            self.capture.annotate(ids=ids, **self.rollouts.annotation(inputs))
            self.announced = True
            return
        if self.pairs is not None:
            self.call_scale = self.loss.grad_scaler_scale()
            self.capture.annotate(ids=ids, **self.pairs.annotation(inputs, num_items))
            self.announced = True
            return
        num = None
        labels = inputs.get("labels") if isinstance(inputs, MutableMapping) else None
        if self.loss is not None:
            call = self.loss.for_call(num_items)
            self.call_scale, num = call.scale, call.num_items
            self.trainer_config["loss"]["rules"] = sorted(self.loss.paths)
            if not self.checked:
                self._probe(call, labels)
        self.capture.annotate(ids=ids, labels=labels, num_items=num)
        self.announced = True

    def _probe(self, call: CallLoss, labels: Any) -> None:
        """Keep the output of the forward call that follows, for :meth:`check_loss`."""
        self.checked = True
        if self.trainer.args.label_smoothing_factor:
            self.trainer_config["check"] = "not checked (label smoothing)"
            return
        probe = self.probe = {"call": call, "labels": labels}

        def keep_output(module: Any, args: Any, output: Any) -> None:
            probe["output"] = output
            probe["handle"].remove()

        probe["handle"] = self.model.register_forward_hook(keep_output)

    def drop_probe(self) -> None:
        if self.probe is not None:
            self.probe["handle"].remove()
            self.probe = None

    def check_loss(self, result: Any) -> None:
        """``compute_loss`` returned: compare its value with the derived convention (once per run)."""
        probe = self.probe
        if probe is None:
            return
        self.drop_probe()
        value = result[0] if isinstance(result, tuple) else result
        ratio = None
        if "output" in probe and isinstance(value, torch.Tensor) and value.numel() == 1:
            ratio = loss_ratio(value, probe["output"], probe["labels"], probe["call"], self.capture.causal_lm)
        if ratio is None:
            self.trainer_config["check"] = "not checked (the model's output has no logits or log-probabilities)"
            return
        args = self.trainer.args
        tolerance = 5e-3 if (args.bf16 or args.fp16) else 1e-3
        self.trainer_config["check"] = {"loss_ratio": ratio}
        aux = _weighted_aux_loss(probe["output"], self.model)
        if aux is not None and abs(ratio - 1.0) > tolerance:
            # a MoE load-balancing loss is part of the Trainer's loss: weighted by router_aux_loss_coef, once per
            # micro-batch (the model's own loss) or divided by the accumulation steps (TRL's trainers)
            expected = float(value.detach().float()) / ratio
            steps = max(int(getattr(self.trainer, "current_gradient_accumulation_steps", 1) or 1), 1)
            ratio = min((ratio - aux / divisor / expected for divisor in (1, steps)), key=lambda r: abs(r - 1.0))
            self.trainer_config["check"] = {"loss_ratio": ratio, "aux_loss": aux}
        if abs(ratio - 1.0) > tolerance:
            raise ValueError(
                f"gradtrace: the Trainer's loss is {ratio:.4g}x what GradtraceCallback derived from the Trainer's "
                f"settings ({probe['call'].path}: the examples' summed token losses divided by "
                f"{'num_items_in_batch' if probe['call'].num_items is not None else 'their target count'}). A custom "
                "compute_loss or compute_loss_func, or a model whose loss ignores num_items_in_batch, needs the "
                "convention stated: GradtraceCallback(..., loss=Loss(reduction='mean' | 'sum' | 'token_mean', "
                "scale=...)) (see gradtrace.capture). Loss(check=False) skips this check.")

    def _strip_ids(self, module: Any, args: tuple, kwargs: dict) -> Any:
        announced, self.announced = self.announced, False
        if self.capturing and torch.is_grad_enabled() and module.training and not announced:
            raise RuntimeError("gradtrace: the Trainer ran a training forward call that did not go through "
                               "Trainer.compute_loss (or two in one compute_loss call), so its examples' ids and "
                               "loss scale are unknown. The Trainer integration supports training steps that call "
                               "the model once per compute_loss; use gradtrace.capture directly otherwise")
        if ID_KEY not in kwargs:
            return None
        kwargs = {k: v for k, v in kwargs.items() if k != ID_KEY}
        return args, kwargs

    # -- per step ------------------------------------------------------------------------------
    def epoch_begin(self, state: Any) -> None:
        self.epoch = _epoch_index(state)
        if self.cb.ids is None and self.capture is not None:
            self.capture.reset_ids()  # the same content in a new epoch is the same example

    def _lr(self) -> float:
        groups = self.trainer.optimizer.param_groups
        if not self._lr_warned and len({float(g["lr"]) for g in groups}) > 1:
            self._lr_warned = True
            warnings.warn("gradtrace: the optimizer's parameter groups have different learning rates; rows record "
                          "group 0's", stacklevel=3)
        return float(groups[0]["lr"])

    def step_begin(self, state: Any) -> None:
        lr = self._lr()
        self.lrs.append(lr)
        step = state.global_step - self.cb.start_step
        if step < 0 or step % self.cb.every != 0:
            return
        self.rows.position = {"step": int(state.global_step), "epoch": self.epoch, "lr": lr}
        steps = self.trainer_config.setdefault("steps", {"first": int(state.global_step)})
        steps["last"] = int(state.global_step)  # the captured step range
        if self.entered:  # coverage warnings were given at the first step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.capture.__enter__()
        else:
            self.capture.__enter__()
            self.entered = True
        if self.unfused is not None:
            self.unfused.install()
        self.capturing = True
        self.announced = False

    def step_end(self) -> None:
        if not self.capturing:
            return
        self.capturing = False
        if self.unfused is not None:
            self.unfused.remove()
        self.capture.__exit__(None, None, None)

    # -- checkpoints -----------------------------------------------------------------------------
    def saved(self, args: Any, state: Any) -> None:
        folder = os.path.abspath(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        entry = {"step": int(state.global_step), "path": relative_path(folder, self.cb.path),
                 "epoch": float(state.epoch or 0.0), "lr": self._lr(),
                 "mean_lr": sum(self.lrs) / len(self.lrs) if self.lrs else None, "updates": len(self.lrs),
                 "weights": self._weights()}  # every rank: the fingerprint gathers FSDP2 shards
        self.lrs = []
        self.saves.append(entry)
        self.trainer_config["checkpoints"] = list(self.saves)
        names = self.trainer_config.get("optimizer_parameters")
        if args.process_index == 0 and names and os.path.isfile(os.path.join(folder, "optimizer.pt")):
            # beside optimizer.pt: what maps its grouped state to the model, for whoever reads the directory alone
            atomic_write_json(Path(folder) / OPTIMIZER_NAMES_FILE, {"optimizer_parameters": names,
                                                                    "step": int(state.global_step)})
        if args.process_index == 0 and self.writer is not None and self.writer.writer is not None:
            record_checkpoints(self.cb.path, [entry], self.trainer_config)

    def _weights(self) -> str | None:
        """The fingerprint of the model's current weights (what ``gradtrace score`` compares a loaded model with)."""
        return model_fingerprint(self.model).get("weights") if self.model is not None else None

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, error: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.capturing:
            self.capturing = False
            if self.unfused is not None:
                self.unfused.remove()
            self.capture.__exit__(type(error) if error else None, error, None)
        if self.unfused is not None and self.unfused.used:
            self.trainer_config["fused_lm_head"] = "unfused"
        if self.writer is None:
            return
        if error is None:  # the trained model (trainer.save_model() writes it to the output dir)
            self.trainer_config["final"] = {"step": int(self.trainer.state.global_step), "weights": self._weights()}
        opened = self.writer.writer is not None
        self.writer.on_capture_end(self.capture, error)
        if not opened:
            if error is None:
                warnings.warn("gradtrace: no gradients were captured during training (no captured step ran a "
                              "backward pass)", stacklevel=2)
            return
        if self.trainer.args.process_index == 0:
            record_checkpoints(self.cb.path, self.saves, self.trainer_config)

    def abort(self, error: BaseException) -> None:
        try:
            self.finish(error)
        except Exception as secondary:  # keep the training error as the one raised
            warnings.warn(f"gradtrace: closing the capture after the training error failed too: {secondary!r}",
                          stacklevel=2)


def _optimizer_parameter_names(optimizer: Any, model: Any) -> list[str] | None:
    """Names of the optimizer's parameters in its order (the Trainer groups them by weight decay), so that the
    optimizer state of a checkpoint can be matched to the model (for ``less_features``: as each param group's
    ``"param_names"`` of its state dict)."""
    if optimizer is None:
        return None
    names = {id(p): strip_wrappers(n) for n, p in unwrap(model).named_parameters()}
    return [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]


def _is_causal_lm(model: Any) -> bool:
    """Whether the model's labels are shifted by one (a causal LM), looking through PEFT wrappers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    name = type(base).__name__
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or "CausalLM" in name or "LMHead" in name


def _epoch_index(state: Any) -> int:
    return math.floor((state.epoch or 0.0) + 1e-6)


def _describe_scale(scale: Any) -> Any:
    return scale if isinstance(scale, (int, float)) or scale is None else getattr(scale, "__name__", repr(scale))


def _weighted_aux_loss(output: Any, model: Any) -> float | None:
    """``router_aux_loss_coef * aux_loss`` of a MoE model's output (None when it has none)."""
    aux = getattr(output, "aux_loss", None)
    config = getattr(getattr(model, "module", model), "config", None)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not isinstance(aux, torch.Tensor) or aux.numel() != 1 or coef == 0.0:
        return None
    return coef * float(aux.detach().float())
