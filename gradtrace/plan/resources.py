"""What the machine has where a stage writes or runs: free disk space, available memory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["available_memory", "free_space"]


def free_space(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free



def available_memory(device: Any = None) -> int | None:
    """Bytes of memory available where tensors of ``device`` live: free CUDA memory, else the host's
    ``MemAvailable`` (Linux); None when unknown."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
