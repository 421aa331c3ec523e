"""Integrations with training frameworks.

* :mod:`gradtrace.integrations.hf`: ``GradtraceCallback`` for the Hugging Face ``Trainer`` and TRL's trainers
  (needs ``transformers``).

Plain PyTorch loops, and trainers without a callback API (OLMo-core), use ``gradtrace.capture`` directly:
see ``docs/integrations/``.
"""

__all__ = ["GradtraceCallback"]


def __getattr__(name: str):
    if name == "GradtraceCallback":  # imported lazily: it needs transformers
        from .hf import GradtraceCallback

        return GradtraceCallback
    raise AttributeError(f"module 'gradtrace.integrations' has no attribute {name!r}")
