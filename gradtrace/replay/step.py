"""One recorded training step as a function: ``state_{t+1} = step_t(state_t, w_t)``.

The weights ``w`` of the step's examples enter each micro-batch loss the way the recorded loop reduced it
(:class:`gradtrace.replay.Reduction`): ``L_m = sum_i w_i l_i / D_m`` (``/ accumulation`` when the loop divides),
with ``w = 1`` giving the recorded run. The gradient is summed over micro-batches in their order (as
``param.grad`` accumulates), clipped and handed to :func:`gradtrace.replay.optim.optimizer_step`.

``loss_fn(forward, batch)`` is the user's loss: ``forward`` behaves like the model (``forward(**inputs)``; in the
recorded loop it *is* the model) and the result is the per-example losses ``[B]``, or ``(losses [B],
counts [B])`` for a token mean (``losses[i]`` the sum of example ``i``'s token losses, ``counts[i]`` its loss
tokens). ``batches(ids)`` returns the batch of the examples ``ids`` in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .exact import torch_step
from .optim import OptimState, init_state, optimizer_step
from .run import RecordedRun
from .spec import ReplayError

__all__ = ["BatchFn", "LossFn", "StepFunction"]

LossFn = Callable[[Callable[..., Any], Any], "Tensor | tuple[Tensor, Tensor]"]
BatchFn = Callable[[list[Any]], Any]


class StepFunction:
    """The steps of a recorded run over the user's model, loss and data.

    Args:
        run: the recorded run.
        model: a model with the recorded parameters (its own values are not used: ``torch.func.functional_call``
            runs it on the replayed state).
        loss_fn: ``loss_fn(forward, batch) -> losses [B]`` or ``(losses [B], counts [B])``.
        batches: ``batches(ids) -> batch`` for a list of example ids.

    Raises:
        ReplayError: a model that does not match the run.
    """

    def __init__(self, run: RecordedRun, model: torch.nn.Module, loss_fn: LossFn, batches: BatchFn) -> None:
        run.check_model(model)
        self.run, self.model, self.loss_fn, self.batches = run, model, loss_fn, batches
        self.names = run.optimizer.param_names()
        device = next(iter(model.parameters())).device
        self.constants = {name: t.to(device) for name, t in run.initial.items() if name not in set(self.names)}
        self.device = device

    def initial_state(self) -> OptimState:
        """The state before the first step (the recorded initial weights, on the model's device)."""
        return init_state({name: self.run.initial[name].to(self.device) for name in self.names})

    def forward(self, params: dict[str, Tensor]) -> Callable[..., Any]:
        """A callable running the model on ``params`` (and the recorded constants: frozen parameters, buffers)."""
        tensors = {**self.constants, **params}

        def call(*args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(self.model, tensors, args, kwargs)

        return call

    def _batch(self, t: int, ids: Sequence[Any]) -> Any:
        try:
            return self.batches(list(ids))
        except (KeyError, IndexError) as err:
            raise ReplayError(f"batches(ids) failed at step {t} for ids {list(ids)[:5]}...: "
                              f"{type(err).__name__}: {err}") from err

    def _losses(self, t: int, forward: Callable[..., Any], ids: Sequence[Any]) -> tuple[Tensor, Tensor | None]:
        out = self.loss_fn(forward, self._batch(t, ids))
        losses, counts = (out if isinstance(out, tuple) else (out, None))
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (len(ids),):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ReplayError(f"loss_fn must return per-example losses of shape [{len(ids)}] at step {t}, got "
                              f"{shape}")
        if self.run.reduction.kind == "token_mean" and counts is None:
            raise ReplayError("Reduction(kind='token_mean') needs loss_fn to return (losses, counts)")
        return losses, counts

    def weights_at(self, t: int, weights: Mapping[Any, float]) -> list[Tensor]:
        """The ``[B_m]`` weight vectors of step ``t``'s micro-batches from ``{id: w_i}`` (1 for absent ids)."""
        dtype = self.run.initial[self.names[0]].dtype
        return [torch.tensor([float(weights.get(i, 1.0)) for i in ids], dtype=dtype, device=self.device)
                for ids in self.run.steps[t].micro_batches]

    def micro_losses(self, t: int, params: dict[str, Tensor],
                     weights: Sequence[Tensor] | None = None) -> list[Tensor]:
        """The loss the loop differentiated for each micro-batch of step ``t``, with example weights.

        Args:
            t: the step.
            params: the optimized parameters at ``theta_t``.
            weights: one ``[B_m]`` weight vector per micro-batch (None: all ones, the recorded run).

        Returns:
            one scalar ``L_m = sum_i w_i l_i / D_m`` per micro-batch.
        """
        step, reduction = self.run.steps[t], self.run.reduction
        forward = self.forward(params)
        outs = [self._losses(t, forward, ids) for ids in step.micro_batches]
        if reduction.num_items_in_batch:
            total = sum(counts.detach().sum() for _, counts in outs)
        result = []
        for m, (losses, counts) in enumerate(outs):
            w = weights[m] if weights is not None else torch.ones_like(losses)
            loss = (w * losses).sum()
            if reduction.kind == "mean":
                loss = loss / len(losses)
            elif reduction.kind == "token_mean":
                loss = loss / (total if reduction.num_items_in_batch else counts.detach().sum())
            if reduction.divide_by_accumulation and self.run.accumulation > 1:
                loss = loss / self.run.accumulation
            result.append(loss)
        return result

    def gradient(self, t: int, params: dict[str, Tensor], weights: Sequence[Tensor] | None = None,
                 create_graph: bool = False) -> dict[str, Tensor | None]:
        """``g_t = sum_m dL_m / d theta`` at ``params`` (which must require grad), micro-batches in order.

        Returns:
            the gradient of each optimized parameter (None where no loss reaches it).
        """
        plist = [params[name] for name in self.names]
        total: list[Tensor | None] = [None] * len(plist)
        for loss in self.micro_losses(t, params, weights):
            grads = torch.autograd.grad(loss, plist, create_graph=create_graph, allow_unused=True)
            total = [g if acc is None else (acc if g is None else acc + g) for acc, g in zip(total, grads)]
        return dict(zip(self.names, total))

    def step(self, t: int, state: OptimState, weights: Sequence[Tensor] | None = None,
             create_graph: bool = False) -> OptimState:
        """``state_{t+1}`` from ``state_t``: gradient, clipping, optimizer update.

        Args:
            t: the step.
            state: the state before it; with ``create_graph`` its tensors are the inputs of the graph built.
            weights: per micro-batch example weights (None: ones).
            create_graph: build the graph of the new state over ``state`` and ``weights`` (for metagradients:
                the differentiable formulas of :mod:`.optim`); without it the new state comes from torch's own
                optimizer kernels (:func:`gradtrace.replay.exact.torch_step`), as the recorded loop computed it.

        Returns:
            the state after step ``t``.
        """
        lrs = list(self.run.steps[t].lrs)
        if create_graph:
            grads = self.gradient(t, state.params, weights, create_graph=True)
            return optimizer_step(self.run.optimizer, state, grads, lrs, self.run.grad_clip)
        params = {name: p.detach().requires_grad_(True) for name, p in state.params.items()}
        grads = self.gradient(t, params, weights)
        # the states themselves through torch's own kernels (the recorded foreach / fused path): bit for bit
        return torch_step(self.run.optimizer, state.detached(),
                          {k: None if g is None else g.detach() for k, g in grads.items()}, lrs, self.run.grad_clip)
