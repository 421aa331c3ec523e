"""The bottom floor: small helpers every layer of gradtrace uses, importing nothing from gradtrace above them.

* :mod:`.models` -- a model's parameter and module names whatever wraps it (DDP, FSDP1, ``torch.compile``,
  activation checkpointing), and its context length;
* :mod:`.batches` -- moving a user's batch (tensors, or dicts/lists/tuples of them) to a device;
* :mod:`.ranks` -- this process's rank and the world size.

The per-example losses, ``LossFn`` and ``LossConvention`` are on the same floor in :mod:`gradtrace.loss.functions`, the
version in :mod:`gradtrace.version` (see ``docs/architecture.md``).
"""

from .batches import to_device
from .modules import canonical_param_names, context_limit, strip_wrappers, unwrap
from .ranks import rank_and_world

__all__ = ["canonical_param_names", "context_limit", "rank_and_world", "strip_wrappers", "to_device", "unwrap"]
