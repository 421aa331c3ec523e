"""``gradtrace.capture``: per-example gradients from an unmodified training loop.

How it works, in one pass of a loop:

1. A forward pre-hook on the model reads the batch (rows, padding, packed documents, labels) into a
   :class:`ForwardContext`.
2. A forward hook on every captured module keeps what the gradient rule needs (the layer input,
   projected right away under LoGra) and registers a hook on the module's output tensor. Output
   hooks pair each call's activations with exactly that call's output-gradient, which makes modules
   called several times, tied weights and gradient checkpointing (re-run forwards) exact. What is
   kept passes through autograd's saved-tensor hooks (:mod:`.saved`): under non-reentrant
   checkpointing it is recomputed by the re-run forward, not held from the first one.
3. When the output-gradient arrives, the layer handler turns it into per-example gradient terms
   (loss scale removed).
4. An autograd-engine callback fires when the backward pass is complete; the terms are assembled
   into a :class:`GradientBatch` (:mod:`.build`), kept in ``capture.batches`` and/or handed to callbacks
   (:class:`CaptureCallback`). Example ids come from :mod:`.example_ids`.

Nothing in the user's model is replaced or wrapped; on exit every hook is removed.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..common.checks import nonzero
from ..common.modules import unwrap
from ..grad.batch import GradientBatch
from ..loss.functions import LossConvention
from ..options import CaptureOptions, Loss
from ..options.base import option_object
from ..projection.logra import Projector, check_projection_size, per_layer, unmatched_ranks
from .assemble import SiteResult, build_batch, outside_examples, zero_outside
from .callbacks import CaptureCallback, as_callback
from .context import BatchInfo, ContextSettings, ForwardContext, call_context
from .coverage import CaptureReport, Coverage, coverage_of, enforce
from .example_ids import ExampleIds
from .forward_watch import watch_hooks
from .layer_selection import select_layers
from .layers import LayerHandler
from .saved import Kept
from .token_rows import batch_shared, match_rows, output_tensors, row_view
from .verify import check_batch_sum

__all__ = ["Capture", "CaptureCallback", "capture"]

class SidePass:
    """Batches captured inside :meth:`Capture.side_pass`."""

    def __init__(self) -> None:
        self.batches: list[GradientBatch] = []
        self.count = 0


class _Ambiguous:
    """Marker context for re-run forwards that cannot be matched to one forward call."""


_AMBIGUOUS = _Ambiguous()


class Capture:
    """Context manager capturing per-example gradients of every backward pass inside it.

    Args:
        model: the model the loop calls (plain, DDP-wrapped, PEFT, FSDP2 ``fully_shard``-ed).
        loss: how the loop's loss is read (:class:`gradtrace.Loss`: its reduction, default ``"mean"``; the
            per-example loss each gradient belongs to; a loss scale, default 1; label layout). Its ``fn`` must be
            None: the loop computes the loss.
        options: what is captured and how (:class:`gradtrace.CaptureOptions`).
        ids: example ids consumed in order (one per example, per document for packed rows); without
            them and without :meth:`annotate`, ids are content hashes of each example's tokens.
        callbacks: objects with ``on_batch(batch, capture)`` (see :class:`CaptureCallback`) or plain
            callables ``fn(batch)``.
        keep_batches: keep batches in ``capture.batches`` (default: only when there are no callbacks).
    """

    def __init__(self, model: nn.Module, loss: Loss | None = None, *, options: CaptureOptions | None = None,
                 ids: Sequence[Any] | None = None, callbacks: Sequence[Any] = (),
                 keep_batches: bool | None = None) -> None:
        options = option_object(options, CaptureOptions, "options")
        loss = option_object(loss, Loss, "loss")
        if loss.fn is not None:
            raise ValueError("capture(): the training loop computes the loss; leave Loss.fn None (it is for the "
                             "passes gradtrace runs itself: collect, fit_curvature)")
        self.loss = replace(loss, reduction=loss.reduction or "mean", scale=1.0 if loss.scale is None else loss.scale)
        projection = per_layer(options.projection, "capture")
        if projection is not None and options.keep_tokens and not projection.keep_tokens:
            projection = replace(projection, keep_tokens=True)
            options = replace(options, projection=projection)
        self.options = options
        self.model = model
        self.convention = LossConvention(self.loss.reduction, self.loss.example_loss)
        self.loss_scale = self.loss.scale
        self.projection = projection
        if projection is None and options.grad_dtype != "float32":
            raise ValueError(f"grad_dtype={options.grad_dtype!r} sets the dtype of LoGra's projection products; "
                             "without a projection every product is already float32 (give projection=LoGra(...))")
        self.projector = Projector(projection, options.grad_dtype) if projection is not None else None
        self.callbacks = list(callbacks)
        self.keep_batches = (not self.callbacks) if keep_batches is None else keep_batches
        self.packing = options.packing
        self.multi_forward = options.multi_forward
        self.broadcast = options.broadcast
        self.ignore_index = self.loss.ignore_index
        self.nonfinite = options.nonfinite
        self.isolate_padding = options.isolate_padding
        self.partial = options.partial
        self.verify = options.verify
        name = type(unwrap(model)).__name__
        self.causal_lm = self.loss.causal_lm if self.loss.causal_lm is not None else \
            ("CausalLM" in name or "LMHead" in name)

        self.selection = select_layers(model, options.layers, options.exclude, options.include_frozen)
        self.handlers: list[LayerHandler] = self.selection.handlers
        if projection is not None and projection.ranks:
            names = [n for h in self.handlers for n in h.params.values()]
            unmatched = unmatched_ranks(projection, names)
            if unmatched:
                raise ValueError(f"LoGra ranks= globs {unmatched} match no captured parameter (captured: "
                                 f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
        if projection is not None:
            check_projection_size(projection, {h.params[r]: h.shapes[r] for h in self.handlers for r in h.params})
        self.batches: list[GradientBatch] = []
        self.num_backward = 0
        self._ids = ExampleIds(ids)
        self._handles: list[Any] = []
        self._hooked: dict[int, Tensor] = {}  # parameters with a gradient hook (kept alive: ids stay unique)
        self._active = False
        self._pending_info: BatchInfo | None = None
        self._report = CaptureReport.from_selection(self.selection)
        self.track_outputs = False  # collect() sets this to backpropagate to layer outputs only
        self._outputs: list[Tensor] = []
        self._side: SidePass | None = None
        self._reset_step()
        enforce(self.coverage())  # before the loop runs: a trainable parameter no rule covers, unless partial

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Capture:
        if self._active:
            raise RuntimeError("this capture is already active")
        unsupported = self.selection.unsupported  # left out with partial=True (or frozen ones with include_frozen)
        if unsupported:
            listing = "; ".join(f"{u.module} ({u.type_name}: {u.reason})" for u in unsupported[:6])
            more = f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else ""
            warnings.warn(f"gradtrace: {len(unsupported)} module(s) with trainable parameters cannot be captured per "
                          f"example and are left out: {listing}{more}; coverage: {self.coverage().line()}. See "
                          "capture.report().", stacklevel=2)
        self._install()
        self._active = True
        self._forwards_with_grad = 0
        try:
            for cb in self._callbacks():
                cb.on_capture_start(self)
        except BaseException:  # __exit__ will not run: leave the model without hooks
            self._remove()
            self._active = False
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._remove()
        self._active = False
        self._reset_step()
        if exc is None:
            if self.num_backward == 0 and self._forwards_with_grad:
                warnings.warn("gradtrace: no backward pass ran inside capture(); nothing was captured", stacklevel=2)
            left = self._ids.unused()
            if left:
                warnings.warn(f"gradtrace: {left} of the given ids were not used (fewer examples were "
                              "captured than ids given)", stacklevel=2)
        for cb in self._callbacks():
            cb.on_capture_end(self, exc)

    def _callbacks(self) -> list[CaptureCallback]:
        """``self.callbacks`` (a list the caller may extend) as :class:`CaptureCallback` s."""
        return [as_callback(cb) for cb in self.callbacks]

    def _install(self) -> None:
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for handler in self.handlers:
            hook = self._make_layer_hook(handler)
            self._handles.append(handler.module.register_forward_hook(hook, with_kwargs=True))
            self._handles += watch_hooks(handler)  # its leaving hook is prepended: it runs before the layer hook
        # last, so that when the model is itself a captured layer its layer hook still sees the context
        self._handles.append(root.register_forward_hook(self._root_post, with_kwargs=True))
        for handler in self.handlers:
            self._hook_params(handler)
            # FSDP2 (fully_shard) swaps in unsharded parameters just before a forward (its pre-hooks run
            # first), and only those receive gradients through autograd: hook them there
            self._handles.append(handler.module.register_forward_pre_hook(
                lambda module, args, handler=handler: self._hook_params(handler)))

    def _hook_params(self, handler: LayerHandler) -> None:
        """Hook the parameters ``handler``'s module holds now (a module's forward may hold other ones)."""
        for role, name in handler.params.items():
            param = getattr(handler.module, role)
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked[id(param)] = param
                self._handles.append(param.register_hook(self._make_param_hook(name)))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def _reset_step(self) -> None:
        self._contexts: list[ForwardContext] = []
        self._stack: list[ForwardContext | None] = []
        self._results: list[SiteResult] = []
        self._order = itertools.count()
        self._end_queued = False
        self._param_grads: dict[str, Tensor] = {}
        self._params_seen: set[str] = set()
        self._implicit: ForwardContext | None = None
        self._outside: dict[int, Tensor | None] = {}  # isolate_padding: context index -> padded positions

    # ------------------------------------------------------------------ public helpers
    def annotate(self, *, ids: Sequence[Any] | None = None, labels: Tensor | None = None,
                 attention_mask: Tensor | None = None, doc_ids: Tensor | None = None,
                 num_items: float | Tensor | None = None, position_ids: Tensor | None = None,
                 row_examples: Tensor | None = None, example_scale: Tensor | None = None) -> None:
        """State facts about the *next* forward call that the model's arguments do not show.

        ids: one per example (per document for packed rows). labels: ``[B, T]`` targets (for
        ``token_mean`` / ``example_loss="mean"`` when the loop computes the loss outside the model).
        attention_mask, position_ids, doc_ids: padding and packed-document layout. num_items: the
        loop's token-mean denominator. row_examples: ``[B]`` example of each row, for examples of several
        rows (a DPO pair's chosen and rejected rows: ``torch.arange(P).repeat(2)``); their gradient terms sum, and
        a ``"mean"`` reduction is over the examples. example_scale: ``[E]`` each example's factor, given instead of
        the reduction's (a loss normalised per example, as GRPO's per-completion mean; see :class:`BatchInfo`).
        """
        self._pending_info = BatchInfo(ids=ids, labels=labels, attention_mask=attention_mask, doc_ids=doc_ids,
                                       num_items=num_items, position_ids=position_ids, row_examples=row_examples,
                                       example_scale=example_scale)

    def reset_ids(self) -> None:
        """Forget seen content hashes (a new epoch: repeated content is the same example again)."""
        self._ids.reset()

    def report(self) -> CaptureReport:
        """What is captured, what is left out and why, and the share of trainable parameters captured (printable)."""
        self._report.num_backward = self.num_backward
        self._report.coverage = self.coverage()
        return self._report

    def coverage(self) -> Coverage:
        """The share of the trainable parameters captured per example, as known so far (:class:`Coverage`)."""
        return coverage_of(self.model, self.selection, self._report, self.partial)

    def _left_out(self, message: str, when: str) -> None:
        """Something found left out while running: an error naming the fixes when it leaves out a trainable
        parameter without ``partial`` (:func:`enforce`), else ``message`` as a warning."""
        enforce(self.coverage(), when)
        warnings.warn(message, stacklevel=3)

    def clear(self) -> None:
        """Drop the batches kept in memory."""
        self.batches.clear()

    @contextlib.contextmanager
    def side_pass(self, reduction: str = "sum", example_loss: str | None = None) -> Iterator[SidePass]:
        """Capture a separate pass (e.g. a validation batch) without it counting as training.

        Backward passes inside deliver their :class:`GradientBatch` es only to the yielded object's ``batches``:
        not to callbacks, not to ``capture.batches``, not counted in ``num_backward``. The loss convention
        is overridden for the pass (``reduction``, default ``"sum"`` of per-example losses; no loss scale),
        and layer outputs are tracked, so ``torch.autograd.grad(loss, capture.pop_outputs())`` captures the
        pass without touching ``param.grad``.
        """
        if self._side is not None:
            raise RuntimeError("side passes do not nest")
        Loss(reduction=reduction)  # checks it
        side = SidePass()
        saved = (self.convention, self.loss_scale, self.track_outputs, self._outputs)
        self.convention = LossConvention(reduction, example_loss or self.convention.example_loss)
        self.loss_scale = 1.0
        self.track_outputs = True
        self._outputs = []
        self._side = side
        try:
            yield side
        finally:
            self.convention, self.loss_scale, self.track_outputs, self._outputs = saved
            self._side = None

    def pop_outputs(self) -> list[Tensor]:
        """Outputs of the captured layer calls since the last call (with ``track_outputs`` on).

        ``torch.autograd.grad(loss, capture.pop_outputs())`` fires every capture hook while computing no
        parameter gradient at all: the weight-gradient work of the backward pass is skipped.
        """
        outputs, self._outputs = self._outputs, []
        return outputs

    # ------------------------------------------------------------------ forward side
    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._end_queued and torch._C._current_graph_task_id() == -1:
            warnings.warn("gradtrace: the previous backward pass did not complete; its partial results are "
                          "dropped", stacklevel=2)
            self._reset_step()
        info = self._pending_info or BatchInfo()
        self._pending_info = None
        for handler in self.handlers:  # parameters the model's forward may use functionally (FSDP2: unsharded now)
            self._hook_params(handler)
        if not torch.is_grad_enabled():
            self._stack.append(None)
            return
        context = self._new_context(args, kwargs, info)
        self._forwards_with_grad += 1
        self._contexts.append(context)
        self._stack.append(context)

    def _new_context(self, args: tuple, kwargs: dict, info: BatchInfo) -> ForwardContext:
        scale = float(self.loss_scale()) if callable(self.loss_scale) else float(self.loss_scale)
        if callable(self.loss_scale):  # a fixed one was checked by CaptureOptions; gradients are divided by it
            nonzero(scale, "loss_scale (the value its callable returned)")
        settings = ContextSettings(self.convention, scale, self.causal_lm, self.ignore_index, self.packing)
        return call_context(len(self._contexts), args, kwargs, info, settings)

    def _root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        context = self._stack.pop() if self._stack else None
        if context is None:
            return
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_root_grad)

    def _on_root_grad(self, grad: Tensor) -> None:
        self._ensure_end_callback()

    def _context_for_layer(self, inputs: Tensor) -> ForwardContext | _Ambiguous | None:
        if self._stack:
            return self._stack[-1]
        if torch._C._current_graph_task_id() != -1:
            # a forward re-run during backward (activation checkpointing): it belongs to this step
            return self._contexts[0] if len(self._contexts) == 1 else _AMBIGUOUS
        if self._implicit is None:  # a submodule called outside the model's own forward
            settings = ContextSettings(self.convention, 1.0, self.causal_lm, self.ignore_index, False)
            self._implicit = ForwardContext(len(self._contexts), batch_size=inputs.shape[0], seq_len=None,
                                            content=inputs,
                                            info=BatchInfo(), settings=settings)
            self._contexts.append(self._implicit)
            self._report.notes.append("layers were called outside model.forward(): their calls form one batch")
        return self._implicit

    def _make_layer_hook(self, handler: LayerHandler) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            tensor = handler.output_tensor(output)
            if tensor is None or not torch.is_grad_enabled():
                if tensor is None and torch.is_grad_enabled():
                    self._call_unsupported(handler, output)
                return None
            if not tensor.requires_grad:
                trainable = any(getattr(module, role).requires_grad for role in handler.params)
                reason = ("its output does not require grad although its parameters do (its forward, or a hook on it, "
                          "detaches or replaces the output)" if trainable else "its output does not require grad "
                          "(frozen parameters and an input that does not require grad)") + ", so no gradient reaches it"
                if self._stack and self._stack[-1] is not None and self._report.skip_runtime(handler.name, reason):
                    self._left_out(f"gradtrace: {handler.name} is left out: {reason}", " (found while running)")
                return None
            inputs = handler.batch_input(args, kwargs).detach()
            context = self._context_for_layer(inputs)
            if context is None:
                return None
            matched = match_rows(context, inputs, tensor, output, self.broadcast == "expand")
            if isinstance(matched, str):  # broadcast="skip" leaves a batch-shared call out as asked
                chosen = self.broadcast == "skip" and batch_shared(context, inputs, tensor)
                if self._report.skip_runtime(handler.name, matched, chosen=chosen):
                    self._left_out(f"gradtrace: {handler.name} is left out: {matched}", " (found while running)")
                return None
            inputs, expanded = matched
            replacement = None
            if expanded is not None:  # a batch-shared output ([1, ...]) expanded to every row
                tensor = output = replacement = expanded
                self._report.note_broadcast(handler.name)
            rows_of = row_view(context, tensor)
            outside = self._padding_of(context) if self.isolate_padding else None
            # the saved inputs need no cleaning: build_batch drops padding's NaN from terms. An output that is one of
            # several (a router's logits) is not replaced: the module's other outputs were computed from it
            if outside is not None and tensor is output:
                viewed = rows_of(output)
                cleaned = zero_outside(viewed, outside)
                if cleaned is not viewed:
                    output = replacement = tensor = cleaned.view(output.shape)
            kept = Kept(handler.keep_call(inputs, args, kwargs, output, self.projector))  # checkpointing: a placeholder
            order = next(self._order)

            def on_grad(grad: Tensor) -> Tensor | None:
                rows = rows_of(grad)
                cleaned = zero_outside(rows, outside, handler.position_dim)
                self._on_layer_grad(handler, context, order, kept, cleaned)
                return cleaned.view(grad.shape) if cleaned is not rows else None

            tensor.register_hook(on_grad)
            if self.track_outputs:
                self._outputs.append(tensor)
            return replacement

        return hook

    def _call_unsupported(self, handler: LayerHandler, output: Any) -> None:
        """Report (once) a call ``handler``'s rule cannot capture, when it says why and its parameters are trainable."""
        reason = handler.call_unsupported(output)
        trainable = any(getattr(handler.module, role).requires_grad for role in handler.params)
        if (reason is not None and trainable and self._stack and self._stack[-1] is not None
                and self._report.skip_runtime(handler.name, reason)):
            self._left_out(f"gradtrace: {handler.name} is left out: {reason}", " (found while running)")

    def _padding_of(self, context: Any) -> Tensor | None:
        """``[B, T]`` positions of a forward call that belong to no example (computed once per call)."""
        if not isinstance(context, ForwardContext):
            return None
        if context.index not in self._outside:
            self._outside[context.index] = outside_examples(context)
        return self._outside[context.index]

    # ------------------------------------------------------------------ backward side
    def _ensure_end_callback(self) -> None:
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._queue_finish)
            self._end_queued = True

    def _queue_finish(self) -> None:
        # Queued again so that it runs after every callback queued during the backward pass: DDP's
        # all-reduce and FSDP's reduce-scatter finish in such callbacks, and capture callbacks must see the
        # final param.grad.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_layer_grad(self, handler: LayerHandler, context: Any, order: int, kept: Kept, grad: Tensor) -> None:
        self._ensure_end_callback()
        if context is _AMBIGUOUS:
            raise RuntimeError(
                f"gradtrace: {handler.name} was re-run during backward (reentrant activation checkpointing) after "
                f"{len(self._contexts)} forward calls; its activations cannot be matched to one of them. Use "
                "non-reentrant checkpointing (use_reentrant=False) or one forward call per backward pass.")
        terms = handler.backward(kept.get(), grad.detach(), context.scales, self.projector)
        self._results.append(SiteResult(context, order, {handler.params[role]: t for role, t in terms.items()}))

    def _make_param_hook(self, name: str) -> Callable:
        def hook(grad: Tensor) -> None:
            self._params_seen.add(name)
            if self.verify:
                self._param_grads[name] = grad.detach().clone()
            self._ensure_end_callback()

        return hook

    def _finish_backward(self) -> None:
        results, seen, param_grads = self._results, self._params_seen, self._param_grads
        self._reset_step()
        if self._side is not None:  # a side pass: its batch goes to the side pass only
            if results:
                self._side.batches.append(build_batch(self, results, self._side.count, self.convention, self._ids))
                self._side.count += 1
            return
        self.num_backward += 1
        step = self.num_backward - 1
        captured = {name for r in results for name in r.terms}
        missing = sorted(seen - captured - self._report.runtime_params())  # those are reported already
        if missing:
            self._report.note_functional(missing)
            self._left_out(f"gradtrace: parameter(s) {', '.join(missing[:5])} received gradients but none of their "
                           "modules' forward hooks saw the computation (functional use, e.g. nn.MultiheadAttention or "
                           "a fused kernel); their per-example gradients are missing from this batch",
                           f" (found at backward pass {step})")
        if not results:
            return
        batch = build_batch(self, results, step, self.convention, self._ids)
        if self.verify:
            problems = check_batch_sum(batch, param_grads, self.projector, handlers=self.handlers)
            if problems:
                raise AssertionError("gradtrace verify: per-example gradients do not sum to the batch gradient: "
                                     + "; ".join(problems))
        if self.keep_batches:
            self.batches.append(batch)
        for cb in self._callbacks():
            cb.on_batch(batch, self)


def capture(model: nn.Module, loss: Loss | None = None, *, options: CaptureOptions | None = None,
            ids: Sequence[Any] | None = None, callbacks: Sequence[Any] = (),
            keep_batches: bool | None = None) -> Capture:
    """Capture per-example gradients of every backward pass: ``with gradtrace.capture(model) as cap:``.

    The arguments are :class:`Capture`'s.
    """
    return Capture(model, loss, options=options, ids=ids, callbacks=callbacks, keep_batches=keep_batches)

