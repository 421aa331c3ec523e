"""The layer-handler protocol and its registry.

A handler holds the per-example gradient math of one module kind and nothing else: which tensor of
the forward call carries the batch, what to keep from the forward pass (activations, possibly
projected), and how to turn the output-gradient into per-example gradient terms. Orchestration
(hooks, batching, ids, loss scale) lives in the collector.

Adding a layer kind is one file with a subclass decorated by :func:`register_layer`.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...grad.terms import OuterTerm, Term, VectorTerm
from ...projection.logra import Projector
from ..assemble import zero_outside

__all__ = [
    "LayerHandler",
    "TokenScale",
    "detached_copy",
    "find_handler",
    "projected_outer",
    "projected_vector",
    "probe_output_scale",
    "register_layer",
    "registered_handlers",
]

TokenScale = Callable[[int, torch.device], Tensor]
"""``scale(num_tokens, device) -> [B, num_tokens]`` float32: the per-token factor turning hook
gradients into per-example loss gradients (the collector supplies it, per forward call)."""

_REGISTRY: list[type[LayerHandler]] = []


def register_layer(cls: type[LayerHandler]) -> type[LayerHandler]:
    """Class decorator adding a handler to the registry (later registrations take precedence)."""
    _REGISTRY.insert(0, cls)
    return cls


def registered_handlers() -> list[type[LayerHandler]]:
    return list(_REGISTRY)


def find_handler(module: nn.Module) -> type[LayerHandler] | None:
    """The handler class for ``module``, or None when no registered kind matches."""
    for cls in _REGISTRY:
        if cls.matches(module):
            return cls
    return None


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def detached_copy(module: nn.Module, params: dict[str, Tensor]) -> nn.Module:
    """A shallow copy of ``module`` for probing its ``forward``: no hooks, the given parameters (frozen),
    private CPU copies of its buffers. Running it never touches the module's own state."""
    # a shallow copy (new __dict__; the dicts below are replaced, never mutated). Not copy.copy: it calls
    # cls.__new__, which for FSDP2 (fully_shard) module classes constructs a new module with no arguments
    clone = object.__new__(type(module))
    clone.__setstate__(dict(module.__dict__))
    for hooks in _HOOK_DICTS:
        if hooks in clone.__dict__:
            clone.__dict__[hooks] = OrderedDict()
    clone._parameters = OrderedDict((k, nn.Parameter(v, requires_grad=False)) for k, v in params.items())
    clone._buffers = OrderedDict(
        (k, None if v is None else v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone())
        for k, v in module._buffers.items())
    return clone


def probe_output_scale(module: nn.Module, stock: type[nn.Module],
                       make_input: Callable[[torch.Generator], Tensor]) -> float | None:
    """How ``module``'s forward relates to ``stock.forward``, the computation a handler's math is written for.

    Returns 1.0 when the class does not override that forward; ``c`` when an override computes ``c`` times
    it for a constant ``c`` (Gemma's and BART's scaled word embeddings); None when it computes anything else
    (other inputs, a causal pad, a weight transform), which a handler must report rather than capture.
    Checked on :func:`detached_copy` copies with two draws of random parameters and inputs.
    """
    if type(module).forward is stock.forward:
        return 1.0
    if any(True for _ in module.children()):
        return None  # submodules would run with the real parameters and state: cannot verify in isolation
    gen = torch.Generator().manual_seed(1234)
    found = []
    for _ in range(2):
        params = {k: torch.randn(p.shape, generator=gen) for k, p in module._parameters.items() if p is not None}
        clone, inputs = detached_copy(module, params), make_input(gen)
        try:
            with torch.no_grad():
                got, want = type(module).forward(clone, inputs), stock.forward(clone, inputs)
        except Exception:  # any failure means "not the stock computation"
            return None
        if not isinstance(got, Tensor) or got.shape != want.shape:
            return None
        got, want = got.to(torch.float32), want.to(torch.float32)
        c = float((got * want).sum() / want.pow(2).sum().clamp(min=1e-30))
        if not torch.allclose(got, c * want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            return None
        found.append(c)
    if abs(found[0] - found[1]) > 1e-4 * abs(found[0]) or found[0] == 0:
        return None
    return 1.0 if abs(found[0] - 1.0) < 1e-6 else found[0]


class LayerHandler:
    """Per-example gradient math of one module kind.

    Subclasses set ``kind``, implement :meth:`matches`, :meth:`param_roles`, :meth:`forward`,
    :meth:`backward`, and may override :meth:`unsupported_reason`, :meth:`batch_input` and :meth:`stock` (the
    stock class whose forward their math describes, against which subclasses overriding it are verified).

    Attributes:
        name: module name inside the model.
        module: the module (never modified).
        params: ``role -> parameter name`` for the parameters being captured (e.g. "weight").
        shapes: ``role -> shape of one example's gradient`` for those parameters.
    """

    kind: ClassVar[str] = "layer"
    activation_side: ClassVar[str | None] = None
    """Which factor of the weight's outer term is the layer input ("rows"/"cols"; None: no outer term).
    Curvature methods append the bias column on that side (K-FAC's ``[a; 1]``)."""
    position_dim: ClassVar[int] = 1
    """The dim of :meth:`output_tensor` holding the call's positions (after the batch dim): 1 for ``[B, T, ...]``;
    attention weights ``[B, heads, T, keys]`` have 2. Padding positions are found along it (``isolate_padding``)."""

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.shapes = {role: tuple(getattr(module, role).shape) for role in params}

    @classmethod
    def matches(cls, module: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def param_roles(cls, module: nn.Module) -> tuple[str, ...]:
        """Attribute names of the parameters this handler can capture."""
        return ("weight", "bias")

    def stock(self) -> tuple[type[nn.Module], Callable[[torch.Generator], Tensor]] | None:
        """The stock class whose forward this handler's math describes and a maker of test inputs for it;
        a module whose class overrides that forward is verified against it (see :func:`probe_output_scale`).
        None: nothing to verify."""
        return None

    @functools.cached_property
    def output_scale(self) -> float | None:
        """Constant the module multiplies the stock forward's output by (1.0 for the stock forward itself;
        None when its forward computes something else)."""
        stock = self.stock()
        return 1.0 if stock is None else probe_output_scale(self.module, *stock)

    def unsupported_reason(self) -> str | None:
        """Why this particular module cannot be captured per example (None when it can).

        Subclasses that override this call ``super().unsupported_reason()`` first.
        """
        if self.output_scale is None:
            stock = self.stock()[0].__name__
            return (f"its class overrides {stock}.forward with a different computation (not {stock}'s output "
                    "times a constant), so this layer kind's gradient rule does not apply")
        return None

    def rescale(self, grad_output: Tensor) -> Tensor:
        """The output-gradient with respect to the stock forward's output (see :attr:`output_scale`)."""
        return grad_output if self.output_scale == 1.0 else grad_output * self.output_scale

    def batch_input(self, args: tuple, kwargs: dict) -> Tensor:
        """The forward-call tensor whose first dimension is the batch."""
        if args and isinstance(args[0], Tensor):
            return args[0]
        for value in kwargs.values():
            if isinstance(value, Tensor):
                return value
        raise ValueError(f"{self.name}: no tensor input found in the forward call")

    def output_tensor(self, output: Any) -> Tensor | None:
        """The tensor of the forward call's output whose gradient the rule needs (the output itself by default; a
        router's logits among its outputs). None: nothing to capture for this call."""
        return output if isinstance(output, Tensor) else None

    def call_unsupported(self, output: Any) -> str | None:
        """Why a call whose :meth:`output_tensor` is None cannot be captured (None: it has nothing to capture). The
        capture reports the module as left out while running, with this reason."""
        return None

    def keep(self, inputs: Tensor, args: tuple, kwargs: dict, projector: Projector | None) -> Any:
        """What the forward hook keeps for :meth:`backward`: :meth:`forward` of the batch input by default; rules that
        need more of the call (an experts layer's routing) override this and get its arguments."""
        return self.forward(inputs, projector)

    def keep_call(self, inputs: Tensor, args: tuple, kwargs: dict, output: Any, projector: Projector | None) -> Any:
        """What the forward hook keeps, given the whole call, its output included: :meth:`keep` by default; a rule
        that needs more of the output than the tensor whose gradient it gets (attention probabilities) overrides
        this."""
        return self.keep(inputs, args, kwargs, projector)

    def watch_forward(self, args: tuple, kwargs: dict) -> Any:
        """A context manager to run around this call's forward (entered in the module's forward pre-hook, left before
        the forward hook: ``gradtrace.capture.forward_watch``), for a rule that reads values computed inside the
        forward; None (the default) watches nothing."""
        return None

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        """Called in the forward hook; returns what :meth:`backward` needs (a tensor, or a tuple, list or dict of
        them: the collector keeps each through the saved-tensor hooks in force, so non-reentrant checkpointing
        recomputes it in the re-run forward, where this is called again and must return the same shapes)."""
        raise NotImplementedError  # pragma: no cover

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        """Per-row gradient terms ``{role: term with leading dims [B, T]}`` from the output gradient.

        ``scale`` gives the per-token loss-scale factors; the returned terms must include them. A role may map to a
        list of terms of the same token layout whose sum is the gradient (kept apart, not joined along tokens).
        """
        raise NotImplementedError  # pragma: no cover

    def describe(self) -> str:
        return f"{self.kind}({type(self.module).__name__})"


def tokens_last(x: Tensor, width: int) -> Tensor:
    """Reshape ``[B, ..., width]`` to ``[B, T, width]`` with ``T`` the product of middle dims."""
    if x.dim() < 2:
        raise ValueError(f"expected a batched input of shape [batch, ..., {width}], got {tuple(x.shape)}")
    return x.reshape(x.shape[0], -1, width)


def projected_vector(projector: Projector, param: str, values: Tensor, scale: TokenScale) -> VectorTerm:
    """The per-example gradient ``sum_t scale_t values_t`` of vector parameter ``param``, LoGra-projected.

    Projection is linear, so when tokens are not kept (``LoGra(keep_tokens=False)``) and every token of a row
    belongs to the row's example (``scale.rows`` is given: rows not packed), the row's tokens are summed first and
    the sum projected: a ``[B, n] x [n, k]`` product instead of ``[B*T, n] x [n, k]`` (the same sum, rounded in
    another order). A padding position holding NaN/inf is set to 0 before the sum (:func:`zero_outside`, no host
    read), as the assembly does to the per-token terms; a NaN/inf inside an example stays and flags it.
    """
    rows = getattr(scale, "rows", None)
    if rows is not None and not projector.spec.keep_tokens:
        values = values.to(torch.float32)
        outside = getattr(scale, "outside", None)
        if outside is not None and values.dim() == 3:
            values = zero_outside(values, outside)
        total = torch.einsum("btn,b->bn", values, rows.to(device=values.device))
        return VectorTerm(projector.project(param, "vector", total).unsqueeze(1))
    return VectorTerm(scaled(projector.project(param, "vector", values), scale))


def projected_outer(projector: Projector, rows: Tensor, cols: Tensor, scale: TokenScale) -> OuterTerm:
    """The per-example gradient ``sum_t rows_t cols_t^T`` of a matrix parameter from LoGra-projected factors
    ``rows`` ``[B, T, k_r]`` (the per-token scale already applied) and ``cols`` ``[B, T, k_c]``.

    When tokens are not kept and rows are not packed (``scale.rows`` is given), each row's tokens are summed here,
    in the hook: the ``[B, k_r, k_c]`` sum is held as ``k_c`` pseudo-tokens (token ``j``: column ``j`` of the sum,
    times the one-hot ``e_j``), which the assembly sums to the same matrix, instead of ``T`` tokens of both factors
    held until the backward pass ends (``T / k_c`` times less memory). Padding positions holding NaN/inf are set
    to 0 first (:func:`zero_outside`, no host read), as the assembly does to per-token terms.
    """
    k_r, k_c = rows.shape[-1], cols.shape[-1]
    if getattr(scale, "rows", None) is None or projector.spec.keep_tokens:
        return OuterTerm(rows=rows, cols=cols, n_rows=k_r, n_cols=k_c)
    outside = getattr(scale, "outside", None)
    if outside is not None:
        rows, cols = zero_outside(rows, outside), zero_outside(cols, outside)
    total = torch.einsum("btr,btc->brc", rows.to(torch.float32), cols.to(torch.float32))  # [B, k_r, k_c]
    one_hot = torch.eye(k_c, device=total.device).expand(total.shape[0], k_c, k_c)
    return OuterTerm(rows=total.transpose(1, 2), cols=one_hot, n_rows=k_r, n_cols=k_c)


def scaled(x: Tensor, scale: TokenScale) -> Tensor:
    """Multiply ``x`` ``[B, T, n]`` by the per-token scale (result in x's dtype, computed in fp32)."""
    factor = scale(x.shape[1], x.device)
    if x.dtype == torch.float32:
        return x * factor.unsqueeze(-1)
    return (x.to(torch.float32) * factor.unsqueeze(-1)).to(x.dtype)
