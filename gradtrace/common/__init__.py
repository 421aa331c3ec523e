"""The bottom floor: small helpers every layer of gradtrace uses, importing nothing from gradtrace above them.

* :mod:`.models` -- a model's parameter and module names whatever wraps it (DDP, FSDP1, ``torch.compile``,
  activation checkpointing), and its context length;
* :mod:`.batches` -- moving a user's batch (tensors, or dicts/lists/tuples of them) to a device;
* :mod:`.ranks` -- this process's rank and the world size.

The per-example losses, ``LossFn`` and ``LossConvention`` are on the same floor in :mod:`gradtrace.loss.functions`, the
version in :mod:`gradtrace.version` (see ``docs/architecture.md``).
"""

import importlib
from typing import Any

__all__ = ["canonical_param_names", "context_limit", "rank_and_world", "strip_wrappers", "to_device", "unwrap"]

_EXPORTS = {"to_device": ".batches", "canonical_param_names": ".modules", "context_limit": ".modules",
            "strip_wrappers": ".modules", "unwrap": ".modules", "rank_and_world": ".ranks"}


def __getattr__(name: str) -> Any:
    """The helpers above, imported on first use: the torch-free modules of this floor (``checks``, ``paths``,
    ``errors``, ``units``, ``provenance``) are imported without torch (the command line's ``--help`` needs them)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
