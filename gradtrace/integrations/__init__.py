"""Integrations with training frameworks.

* :mod:`gradtrace.integrations.hf`: ``GradtraceCallback`` for the Hugging Face ``Trainer`` and TRL's trainers
  (needs ``transformers``).
* :func:`checkpoints` / :func:`segments`: the checkpoints a ``GradtraceCallback`` run recorded in its store, and
  the optimizer steps and mean learning rate between them (read from the store alone: no ``transformers``).

Plain PyTorch loops, and trainers without a callback API (OLMo-core), use ``gradtrace.capture`` directly:
see ``docs/integrations/``.
"""

from .trainer_store import checkpoints, segments

__all__ = ["GradtraceCallback", "checkpoints", "segments"]


def __getattr__(name: str):
    if name == "GradtraceCallback":  # imported lazily: it needs transformers
        from .hf import GradtraceCallback

        return GradtraceCallback
    raise AttributeError(f"module 'gradtrace.integrations' has no attribute {name!r}")
