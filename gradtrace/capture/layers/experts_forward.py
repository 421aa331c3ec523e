"""The fused experts' hidden values read from their own forward, so that capture does not recompute them.

An experts call of the ``grouped_mm`` implementation (the default of the pinned transformers where the kernel
exists) sorts its routed pairs by expert (``perm = sort(top_k_index.reshape(-1))[1]``), computes every pair's
hidden pre-activation ``h = W1[e] x + b1[e]`` with one grouped product, applies the gate and passes ``z = gate(h)``
to a second grouped product with ``W2``. :class:`GroupedForward` watches one call (a ``TorchFunctionMode`` entered
in the module's forward pre-hook and left before its forward hook) and keeps three tensors the call computed
anyway: ``perm``, ``h`` (the first product's output, its bias added in place) and ``z`` (the second product's
input). With them, and autograd's own gradient at ``h`` (a hook the experts rule registers on it), the rule needs
nothing of the experts' forward or backward again: ``W1 x``, ``W2^T dy`` and the gate's forward and vjp were 60% of
its hooks' time on ``bench/moe_capture.py`` (0.36 s of 2.5 s; 0.10 s after). Autograd keeps the same storage for
the gate's and the second product's backward, so keeping them costs no memory; under non-reentrant checkpointing
they are kept as the rule's other tensors are (placeholders, recomputed by the re-run forward:
``gradtrace.capture.saved``).

Nothing is guessed. The ``ExpertsHandler`` probe runs the module's forward once under the watch, on a copy with
random weights and routing, and uses the watch only if what it read equals the rule's own expression there. Each
call is then checked where it costs nothing: the sort's input is the call's routing, the two products' weights are
the module's own ``W1`` and ``W2``, shapes are the routed pairs', the implementation named in the model's config is
the one probed, and neither value was changed in place after it was made (``Tensor._version``; ``h`` once, by its
bias). A call that
fails a check (another implementation, an override) is recomputed as before, with the same result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["GroupedForward", "pair_positions"]


def _grouped_products() -> frozenset:
    """The functions an experts forward calls for a grouped product: the ATen op (``F.grouped_mm`` calls it) and
    transformers' fallback op where it is registered."""
    found: set[Any] = {getattr(torch, "_grouped_mm", None)}
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        found |= {fallback, getattr(fallback, "default", None)}
    found.discard(None)
    return frozenset(found)


def _storage(t: Any) -> int | None:
    """The address of ``t``'s storage (a host-side attribute: no device read), None for a non-tensor."""
    if not isinstance(t, Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (a subclass, a fake tensor)
        return None


class GroupedForward(TorchFunctionMode):
    """Watches one experts call: the sort of its routing (``perm``), the first grouped product's output (``h``, that
    of ``W1``) and the second's input (``z``, that of ``W2``). :meth:`values` returns them if the call was the
    expected one."""

    _PRODUCTS: frozenset | None = None

    def __init__(self, index: Tensor, w1: Tensor, w2: Tensor) -> None:
        super().__init__()
        if GroupedForward._PRODUCTS is None:
            GroupedForward._PRODUCTS = _grouped_products()
        self.index = index
        self._index_at, self._w1_at, self._w2_at = _storage(index), _storage(w1), _storage(w2)
        self.perm: Tensor | None = None
        self.h: Tensor | None = None
        self.z: Tensor | None = None
        self._h_version = self._z_version = 0
        self.unexpected = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.sort, Tensor.sort):
            if self.perm is None and args and _storage(args[0]) == self._index_at and isinstance(out, tuple):
                self.perm = out[1]
        elif func in GroupedForward._PRODUCTS:
            weight = args[1] if len(args) > 1 else kwargs.get("mat_b", kwargs.get("weight"))
            at = _storage(weight)
            if at == self._w1_at and self.h is None and isinstance(out, Tensor):
                self.h, self._h_version = out, out._version  # a fallback kernel may have written it in place
            elif at == self._w2_at and self.z is None and args and isinstance(args[0], Tensor):
                self.z = args[0]
                self._z_version = self.z._version
            else:
                self.unexpected = True  # a third product, or one of other weights: not the call probed
        return out

    def values(self, pairs: int, h_version: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(perm [P], h [P, R], z [P, I])`` in the forward's order of pairs, or None where the call was not the
        one probed: ``h_version`` is how many times ``h`` may have been changed in place after its product returned
        it (1: its bias added; 0 without a bias)."""
        perm, h, z = self.perm, self.h, self.z
        if self.unexpected or perm is None or h is None or z is None:
            return None
        if perm.shape != (pairs,) or h.dim() != 2 or z.dim() != 2 or h.shape[0] != pairs or z.shape[0] != pairs:
            return None
        if h._version - self._h_version != h_version or z._version != self._z_version:
            return None
        return perm, h, z  # as the forward made them (the caller detaches what it keeps)


def pair_positions(perm: Tensor, order: Tensor) -> Tensor:
    """Where each pair of ``order`` (a sort of the same pairs, e.g. :class:`~.experts.Routing`'s stable one) sits in
    the forward's order ``perm``: ``forward_values.index_select(0, pair_positions(perm, order))`` is in ``order``'s
    order. On the device, no host read."""
    at = torch.empty_like(perm)
    at[perm] = torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype)
    return at.index_select(0, order)
