"""What a layer's forward hook keeps until that call's output-gradient arrives, kept as autograd keeps its own.

The forward hook of a captured layer keeps what the layer's gradient rule needs (its input, or the input's LoGra
projection) for the output-gradient hook of the same call. :class:`Kept` passes it through the saved-tensor hooks in
force when the forward runs (``torch.autograd.graph.saved_tensors_hooks``): packed in the forward hook, unpacked in
the output-gradient hook, exactly as autograd packs and unpacks the tensors its nodes save. Whatever manages the
model's saved activations then manages the capture's too:

* non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, Hugging
  Face's ``gradient_checkpointing_enable``) keeps a placeholder from the first forward and, when one is unpacked,
  re-runs the checkpointed forward; the capture's forward hooks run again there and pack the same tensors, which the
  placeholders then hand back. The capture holds no activation of the first forward until backward, as
  checkpointing holds none; the output-gradient hook still pairs with its own forward call (the placeholder is
  that call's).
* ``torch.autograd.graph.save_on_cpu`` moves them to host memory and back, like the model's activations.

With no hooks in force (a plain step; reentrant checkpointing, whose re-run forward happens inside backward) the
tensors themselves are kept: for a linear or norm layer a view of the input that autograd keeps anyway.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Kept"]

# (pack, unpack) of the innermost saved-tensor hooks in force, or None: what autograd applies to a tensor it saves (a
# private function of torch; a torch without it keeps the values as they are, checkpointing or not, and says so)
_top_hooks: Callable[[bool], tuple[Callable, Callable] | None] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Packed:
    """One tensor as a pack hook returned it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _map(obj: Any, fn: Callable[[Any], Any], leaf: type) -> Any:
    """``obj`` (a ``leaf``, or a tuple, list or dict holding them) with ``fn`` applied to every ``leaf``."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(o, fn, leaf) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn, leaf) for k, v in obj.items()}
    return obj


class Kept:
    """What a forward hook returned for its call's output-gradient hook: packed now by the saved-tensor hooks in
    force (each tensor of a tensor, tuple, list or dict), unpacked once by :meth:`get` in that hook."""

    __slots__ = ("_unpack", "_value")

    def __init__(self, saved: Any) -> None:
        if _top_hooks is None:
            warnings.warn("gradtrace: this torch has no torch._C._autograd._top_saved_tensors_default_hooks, so the "
                          "capture keeps its layers' inputs as they are: under non-reentrant activation checkpointing "
                          "they stay alive until backward (gradients are exact; memory is as without checkpointing)",
                          RuntimeWarning, stacklevel=2)
        hooks = _top_hooks(False) if _top_hooks is not None else None
        if hooks is None:
            self._value, self._unpack = saved, None
            return
        pack, self._unpack = hooks
        self._value = _map(saved, lambda x: _Packed(pack(x)), Tensor)

    def get(self) -> Any:
        """The kept value (under non-reentrant checkpointing: recomputed by the re-run forward, which this may
        start). Call it once per backward pass, inside it, as autograd unpacks a saved tensor."""
        if self._unpack is None:
            return self._value
        unpack = self._unpack
        return _map(self._value, lambda p: unpack(p.value), _Packed)
