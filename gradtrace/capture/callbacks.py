"""The capture callback protocol: what a consumer of captured batches implements.

Every consumer in the package -- the store writer, curvature accumulation, online data selection, the
trajectory writer, LESS features, the Trainer rows -- names :class:`CaptureCallback` as its base and
overrides the hooks it needs; the others are no-ops. A capture also accepts plain callables ``fn(batch)``
and duck-typed objects with some of the hooks: :func:`as_callback` wraps them once, so the capture calls
every hook of every callback without asking which ones exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..grad.batch import GradientBatch
    from .collector import Capture

__all__ = ["CaptureCallback", "as_callback"]

_HOOKS = ("on_capture_start", "on_batch", "on_capture_end")


class CaptureCallback:
    """Base class of the consumers of captured batches (every hook a no-op by default).

    ``on_batch`` runs at the end of each backward pass, after ``param.grad`` is complete and before the
    loop continues (so before ``optimizer.step()``).
    """

    def on_capture_start(self, capture: Capture) -> None:
        """Called when the capture context is entered."""

    def on_batch(self, batch: GradientBatch, capture: Capture) -> None:
        """Called with the per-example gradients of each backward pass."""

    def on_capture_end(self, capture: Capture, error: BaseException | None) -> None:
        """Called when the capture context exits (``error`` is the loop's exception, if any)."""


class _Adapter(CaptureCallback):
    """A duck-typed callback (some of the hooks) or a function ``fn(batch)`` seen as a :class:`CaptureCallback`."""

    def __init__(self, target: Any) -> None:
        self.target = target
        hooks = {name: getattr(target, name) for name in _HOOKS if callable(getattr(target, name, None))}
        if "on_batch" not in hooks and callable(target):
            hooks["on_batch"] = lambda batch, capture: target(batch)
        self._hooks: dict[str, Callable[..., None]] = hooks

    def on_capture_start(self, capture: Capture) -> None:
        self._call("on_capture_start", capture)

    def on_batch(self, batch: GradientBatch, capture: Capture) -> None:
        self._call("on_batch", batch, capture)

    def on_capture_end(self, capture: Capture, error: BaseException | None) -> None:
        self._call("on_capture_end", capture, error)

    def _call(self, name: str, *args: Any) -> None:
        hook = self._hooks.get(name)
        if hook is not None:
            hook(*args)


def as_callback(target: Any) -> CaptureCallback:
    """``target`` as a :class:`CaptureCallback`: itself when it is one, else wrapped (a plain callable receives
    each batch). Anything else is refused with a one-line error."""
    if isinstance(target, CaptureCallback):
        return target
    if not callable(target) and not any(callable(getattr(target, name, None)) for name in _HOOKS):
        raise TypeError(f"gradtrace: a capture callback must be a CaptureCallback, an object with on_batch(batch, "
                        f"capture), or a callable fn(batch); got {type(target).__name__}")
    return _Adapter(target)
