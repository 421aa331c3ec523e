"""The process group gradtrace runs in: torchrun detection, joining the group, the device collectives use (rank and
world size: :func:`gradtrace.common.ranks.rank_and_world`, on the bottom floor for every layer)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..common.ranks import rank_and_world

__all__ = ["comm_device", "is_distributed", "launched_by_torchrun", "process_group"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def is_distributed(group: Any = None) -> bool:
    """Whether a process group with more than one rank is initialized."""
    return rank_and_world(group)[1] > 1


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its environment variables are set) with several ranks."""
    return all(v in os.environ for v in _TORCHRUN_VARS) and int(os.environ["WORLD_SIZE"]) > 1


def comm_device(group: Any = None) -> torch.device:
    """Where tensors must be for collectives of ``group``: the current CUDA device for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(device: str | torch.device = "cpu") -> Iterator[tuple[int, int]]:
    """Run inside the process group of a ``torchrun`` launch; yields ``(rank, world size)``.

    Uses a process group that is already initialized as it is. Under ``torchrun`` (several ranks) it
    initializes one -- NCCL when ``device`` is a CUDA device, which is then taken to be ``cuda:LOCAL_RANK``,
    else gloo -- and destroys it on exit. Otherwise it does nothing and yields ``(0, 1)``.
    """
    if dist.is_available() and dist.is_initialized():
        yield rank_and_world()
        return
    if not (dist.is_available() and launched_by_torchrun()):
        yield 0, 1
        return
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield rank_and_world()
    finally:
        dist.destroy_process_group()
