"""Saving and reading a model's named tensors (parameters and buffers) for a recorded run.

safetensors when it is installed (``*.safetensors``), ``torch.save`` otherwise (``*.pt``); files are written to a
temporary name and renamed, so a run directory never holds half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["model_tensors", "read_tensors", "write_tensors"]

try:  # safetensors is a dependency of transformers; optional here
    from safetensors.torch import load_file as _st_load
    from safetensors.torch import save_file as _st_save
except ImportError:  # pragma: no cover - depends on the environment
    _st_load = _st_save = None


def model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's parameters and buffers by name (tied parameters once, under their first name), detached."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    out.update({name: b.detach() for name, b in model.named_buffers()})
    return out


def write_tensors(path_stem: Path, tensors: dict[str, Tensor]) -> Path:
    """Write ``tensors`` to ``path_stem`` + ``.safetensors`` (or ``.pt``), atomically.

    Returns:
        the path written.
    """
    plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    suffix = ".safetensors" if _st_save is not None else ".pt"
    path = path_stem.with_suffix(suffix)
    tmp = path.with_name(path.name + ".tmp")
    if _st_save is not None:
        _st_save(plain, str(tmp))
    else:  # pragma: no cover
        torch.save(plain, tmp)
    os.replace(tmp, path)
    return path


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Read the tensors :func:`write_tensors` wrote (on the CPU)."""
    if path.suffix == ".safetensors":
        if _st_load is None:  # pragma: no cover
            raise ImportError(f"{path} needs the safetensors package")
        return _st_load(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)
