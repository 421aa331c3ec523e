"""Evaluation tasks: small, deterministic training setups with held-out queries (see :class:`Task`)."""

from __future__ import annotations

from typing import Any

from .base import Task, tensor_digest
from .digits import DigitsConfig, DigitsMLP, DigitsTask
from .digits_mlp import DigitsMLPConfig, DigitsMLPTask, DigitsReLUMLP
from .tinylm import TinyLMConfig, TinyLMTask

__all__ = ["TASKS", "DigitsConfig", "DigitsMLP", "DigitsMLPConfig", "DigitsMLPTask", "DigitsReLUMLP", "DigitsTask",
           "Task", "TinyLMConfig", "TinyLMTask", "get_task", "tensor_digest"]

TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "digits_mlp": DigitsMLPTask, "tinylm": TinyLMTask}


def get_task(name: str, **overrides: Any) -> Task:
    """A task by name (``"digits"``, ``"digits_mlp"``, ``"tinylm"``), with settings overridden by keyword."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}") from None
    return cls(**overrides)
