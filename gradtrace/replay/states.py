"""Optimizer states recorded during the run, so that a replay can start from one instead of the first step.

``RunRecorder(..., keep_states=N)`` writes the state *before* steps ``N, 2N, ...`` -- the optimized parameters, the
optimizer's buffers (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``) and the number of updates
each parameter has had -- to ``states/step-<t>.safetensors``, as torch.optim holds them after ``optimizer.step()``.
A truncated metagradient pass (``MetagradOptions.start_step = K``) then replays from the latest recorded state at
or before ``K`` instead of from the initial weights: the same states bit for bit (the recorded ones are the run's
own), without the ``K`` steps of forward replay. The final-weight check still runs at the end of the replay.

A state file holds ``param/<name>``, ``slot/<name>/<slot>`` and ``count/<name>`` (an int64 scalar) tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .optim import OptimState
from .spec import OptimizerSpec, ReplayError
from .weights import read_tensors, write_tensors

__all__ = ["STATES_DIR", "nearest_state", "read_state", "state_path", "write_state"]

STATES_DIR = "states"
SLOTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


def state_path(run_dir: Path, step: int) -> Path:
    """The stem of the state recorded before ``step`` (``write_tensors`` adds the suffix)."""
    return Path(run_dir) / STATES_DIR / f"step-{step:08d}"


def write_state(run_dir: Path, step: int, spec: OptimizerSpec, params: dict[str, Tensor],
                optimizer: torch.optim.Optimizer, counts: dict[str, int]) -> Path:
    """Write the state before ``step``: ``params`` (name -> the live parameter), the optimizer's buffers of each,
    and ``counts`` (updates so far per parameter name).

    Returns:
        the file written.
    """
    tensors: dict[str, Tensor] = {}
    for name in spec.param_names():
        param = params[name]
        tensors[f"param/{name}"] = param.detach()
        held = optimizer.state.get(param, {})
        for slot in SLOTS[spec.kind]:
            value = held.get(slot)
            if isinstance(value, Tensor):
                tensors[f"slot/{name}/{slot}"] = value.detach()
        if counts.get(name):
            tensors[f"count/{name}"] = torch.tensor(counts[name], dtype=torch.int64)
    (Path(run_dir) / STATES_DIR).mkdir(parents=True, exist_ok=True)
    return write_tensors(state_path(run_dir, step), tensors)


def nearest_state(recorded: dict[int, Path], step: int) -> int:
    """The latest step at or before ``step`` with a recorded state (0, the initial weights, when none)."""
    return max((s for s in recorded if s <= step), default=0)


def read_state(path: Path, step: int, spec: OptimizerSpec, params: dict[str, dict], device: torch.device | str,
               dtype: torch.dtype | None = None) -> OptimState:
    """The :class:`OptimState` recorded before ``step``, on ``device`` (floating tensors cast to ``dtype`` when
    given: a run replayed in another precision), checked against the run's parameters.

    Args:
        path: the state file.
        step: the step it precedes (for the messages).
        spec: the run's optimizer.
        params: the manifest's ``params`` (name -> ``shape``, ``dtype``).
        device: where the replay runs.
        dtype: the replay's floating dtype, or None for the recorded one.

    Raises:
        ReplayError: an unreadable file, a missing or reshaped parameter or buffer, an unknown entry.
    """
    try:
        tensors = read_tensors(path)
    except Exception as err:  # safetensors raises its own error types for a truncated or corrupted file
        raise ReplayError(f"the state recorded before step {step} ({path}) cannot be read: {type(err).__name__}: "
                          f"{err}") from err
    state = OptimState({})
    names = set(spec.param_names())
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        name, _, slot = rest.rpartition("/") if kind == "slot" else (rest, "", "")
        if name not in names or (kind == "slot" and slot not in SLOTS[spec.kind]) or kind not in (
                "param", "slot", "count"):
            raise ReplayError(f"the state recorded before step {step} ({path}) holds {key!r}, which is not a "
                              f"state of this run's {spec.kind} optimizer")
        if kind == "count":
            state.counts[name] = int(value)
            continue
        if list(value.shape) != params[name]["shape"]:
            raise ReplayError(f"the state recorded before step {step} ({path}): {key} has shape "
                              f"{list(value.shape)}, the run's parameter {params[name]['shape']}")
        value = value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
        if kind == "param":
            state.params[name] = value
        else:
            state.slots.setdefault(name, {})[slot] = value
    missing = sorted(names - set(state.params))
    if missing:
        raise ReplayError(f"the state recorded before step {step} ({path}) lacks parameters {missing[:5]}")
    state.params = {name: state.params[name] for name in spec.param_names()}  # the run's order
    return state
