"""Optimizer-state checkpoints of a replay, kept in memory or, past a size, on disk under the run directory.

The reverse pass of :func:`gradtrace.replay.metagradients` restarts the replay from the nearest checkpoint
before each segment of ``k`` steps; with ``k ~ sqrt(T)`` it keeps ``T / k`` checkpoints plus the ``k`` states of
one segment, so memory is ``O(sqrt(T))`` states for one extra forward replay.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import torch

from .optim import OptimState

__all__ = ["CheckpointStore", "default_interval", "state_bytes"]


def default_interval(steps: int) -> int:
    """``ceil(sqrt(T))``: the interval that balances checkpoints against one segment's states."""
    return max(1, math.ceil(math.sqrt(max(steps, 1))))


def state_bytes(state: OptimState) -> int:
    """The bytes of the tensors of one state."""
    return sum(t.numel() * t.element_size() for _, t in state.tensors())


class CheckpointStore:
    """States by step: in memory while they fit ``memory_limit`` bytes, then as files in ``directory``.

    Args:
        directory: under which states go when memory is full, in a folder of their own
            (``metagrad_checkpoints_*``, made on first use and removed by :meth:`close`).
        memory_limit: bytes of states kept in memory.
    """

    def __init__(self, directory: Path, memory_limit: int) -> None:
        self.parent, self.memory_limit = directory, memory_limit
        self.directory: Path | None = None
        self._memory: dict[int, OptimState] = {}
        self._files: dict[int, Path] = {}
        self._used = 0

    def put(self, step: int, state: OptimState) -> None:
        """Keep ``state`` (detached) as the state before ``step``."""
        state = state.detached()
        size = state_bytes(state)
        if self._used + size <= self.memory_limit:
            self._memory[step], self._used = state, self._used + size
            return
        if self.directory is None:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="metagrad_checkpoints_", dir=self.parent))
        path = self.directory / f"state_{step:08d}.pt"
        torch.save({"params": state.params, "slots": state.slots, "counts": state.counts}, path)
        self._files[step] = path

    def get(self, step: int) -> OptimState:
        """The state kept for ``step``."""
        if step in self._memory:
            return self._memory[step]
        data = torch.load(self._files[step], weights_only=True)
        return OptimState(data["params"], data["slots"], data["counts"])

    @property
    def on_disk(self) -> int:
        """How many states went to disk."""
        return len(self._files)

    def close(self) -> None:
        """Drop every state and remove the files written."""
        self._memory.clear()
        self._files.clear()
        if self.directory is not None and self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory = None
