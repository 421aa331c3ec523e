"""A recorded run read back from its directory: manifest, steps, initial and final weights, recorded states."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .optim import OptimState
from .spec import SCHEMA, OptimizerSpec, Reduction, ReplayError
from .states import STATES_DIR, read_state, state_path
from .weights import read_tensors

__all__ = ["RecordedRun", "RecordedStep", "load_run"]


@dataclass(frozen=True)
class RecordedStep:
    """One optimizer step: the example ids of each micro-batch and each parameter group's learning rate."""

    micro_batches: tuple[tuple[Any, ...], ...]
    lrs: tuple[float, ...]


@dataclass
class RecordedRun:
    """Everything a replay needs (see :class:`gradtrace.replay.RunRecorder` for the files)."""

    run_dir: Path
    manifest: dict[str, Any]
    optimizer: OptimizerSpec
    reduction: Reduction
    grad_clip: float | None
    accumulation: int
    steps: list[RecordedStep]
    initial: dict[str, Tensor]  # parameters and buffers before the first step
    final: dict[str, Tensor] | None  # after the last step (None if the file is absent)
    states: dict[int, Path] = field(default_factory=dict)  # step -> the state recorded before it (keep_states)
    dtype: torch.dtype | None = None  # set by cast(): the precision recorded states are read in

    def state(self, step: int, device: torch.device | str) -> OptimState:
        """The optimizer state recorded before ``step`` (a key of :attr:`states`), on ``device``.

        Raises:
            ReplayError: no state recorded there, or one that does not match the run.
        """
        if step not in self.states:
            raise ReplayError(f"{self.run_dir}: no state recorded before step {step} (recorded: "
                              f"{sorted(self.states)[:8]})")
        return read_state(self.states[step], step, self.optimizer, self.manifest["params"], device, self.dtype)

    def example_ids(self) -> list[Any]:
        """The distinct example ids of the run, in the order of their first appearance."""
        seen: dict[Any, None] = {}
        for step in self.steps:
            for micro in step.micro_batches:
                seen.update(dict.fromkeys(micro))
        return list(seen)

    def cast(self, dtype: torch.dtype) -> None:
        """Make the run's floating tensors (initial and final) and the manifest's record of their dtypes ``dtype``,
        in memory (a float32 run replayed in float64; the files are not touched)."""
        convert = lambda tensors: {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.dtype = dtype
        self.initial = convert(self.initial)
        self.final = convert(self.final) if self.final is not None else None
        self.manifest = copy.deepcopy(self.manifest)
        for info in self.manifest["params"].values():
            if info["dtype"] in ("float16", "bfloat16", "float32", "float64"):
                info["dtype"] = str(dtype).removeprefix("torch.")

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model whose parameters are not the recorded ones (names, shapes, dtypes).

        Raises:
            ReplayError: a missing, extra or reshaped parameter.
        """
        params = dict(model.named_parameters())
        recorded = self.manifest["params"]
        missing, extra = sorted(set(recorded) - set(params)), sorted(set(params) - set(recorded))
        if missing or extra:
            raise ReplayError(f"the model does not match the recorded run: missing parameters {missing[:5]}, "
                              f"unexpected parameters {extra[:5]}")
        for name, info in recorded.items():
            shape, dtype = list(params[name].shape), str(params[name].dtype).removeprefix("torch.")
            if shape != info["shape"]:
                raise ReplayError(f"the model does not match the recorded run: {name} has shape {shape}, "
                                  f"recorded {info['shape']}")
            if dtype != info["dtype"]:
                raise ReplayError(f"the model does not match the recorded run: {name} is {dtype}, "
                                  f"recorded {info['dtype']}")


def _weights(run_dir: Path, stem: str) -> Path | None:
    for suffix in (".safetensors", ".pt"):
        if (run_dir / (stem + suffix)).exists():
            return run_dir / (stem + suffix)
    return None


def load_run(run_dir: str | Path) -> RecordedRun:
    """Read a run :class:`~gradtrace.replay.RunRecorder` wrote.

    Args:
        run_dir: the run directory.

    Returns:
        the recorded run.

    Raises:
        ReplayError: no manifest (an unfinished recording), another schema, a step count that does not match.
    """
    run_dir = Path(run_dir)
    path = run_dir / "manifest.json"
    if not path.exists():
        raise ReplayError(f"{run_dir}: no manifest.json (was RunRecorder.finish called?)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("schema") != SCHEMA:
        raise ReplayError(f"{path}: schema {manifest.get('schema')!r}, expected {SCHEMA!r}")
    lines = (run_dir / "steps.jsonl").read_text(encoding="utf-8").splitlines()
    steps = [RecordedStep(tuple(tuple(m) for m in row["micro_batches"]), tuple(row["lr"]))
             for row in map(json.loads, lines) if row]
    if len(steps) != manifest["steps"]:
        raise ReplayError(f"{run_dir}: steps.jsonl holds {len(steps)} steps, the manifest {manifest['steps']}")
    initial = _weights(run_dir, "initial")
    if initial is None:
        raise ReplayError(f"{run_dir}: no initial weights")
    final = _weights(run_dir, "final")
    states = {}
    for step in manifest.get("states", {}).get("steps", []):
        path = _weights(run_dir / STATES_DIR, state_path(run_dir, step).name)
        if path is None:
            raise ReplayError(f"{run_dir}: the manifest lists a state recorded before step {step}, and "
                              f"{state_path(run_dir, step)}.safetensors is missing")
        states[int(step)] = path
    return RecordedRun(run_dir, manifest, OptimizerSpec.from_dict(manifest["optimizer"]),
                       Reduction(**manifest["reduction"]), manifest["grad_clip"], manifest["accumulation"], steps,
                       read_tensors(initial), read_tensors(final) if final is not None else None, states)
