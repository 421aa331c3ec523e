"""Ground truth for attribution quality by retraining: LDS subsets and leave-one-out effects.

The caller supplies two functions, which keeps this module independent of any model or task:

* ``train_fn(indices, seed) -> model`` trains a model on the training examples ``indices`` (``[m]``
  long, sorted) with training seed ``seed``;
* ``outcome_fn(model) -> [Q]`` evaluates the queries: ``-loss`` of each (higher = better, matching the
  sign of attribution scores).

The sampling settings are a :class:`gradtrace.options.eval.LDSOptions`. LDS subsets are drawn one after
another from one generator seeded by its ``seed``, so the first ``S`` subsets are the same whatever the total: a
cached ground truth extends to more subsets and a smaller request reads a prefix. Run ``r`` of every subset trains
with seed ``seed + r`` (the same initialisation and data order for every subset, so outcomes differ only through
the data); ``seed_per_subset=True`` instead gives run ``r`` of subset ``s`` the seed ``seed + s * runs + r``.
``runs > 1`` averages each subset's outcomes over its runs.

A cache directory holds ``groundtruth.safetensors`` (masks, outcomes and, in its header, the metadata)
and a readable copy of the metadata in ``meta.json``. The metadata carries a fingerprint of everything
the outcomes depend on (the task ``config`` and the sampling settings); a cache with another fingerprint
is refused, never silently reused. Partial progress is saved while building, and an interrupted build
resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..options.eval import LDSOptions

__all__ = ["GroundTruth", "StaleGroundTruth", "build_lds_ground_truth", "build_loo_ground_truth",
           "fingerprint", "subset_masks"]

SCHEMA = 1
_TENSORS = "groundtruth.safetensors"
_META = "meta.json"

TrainFn = Callable[[Tensor, int], Any]
OutcomeFn = Callable[[Any], Tensor]


class StaleGroundTruth(RuntimeError):
    """A cached ground truth was built for another configuration (the message lists what differs)."""


@dataclass
class GroundTruth:
    """LDS ground truth: ``masks`` ``[S, N]`` bool (subset membership), ``outcomes`` ``[S, Q]`` float64
    (``-loss`` of each query under the model retrained on each subset, averaged over runs) and ``meta``
    (fingerprint, configuration, sampling settings, timings)."""

    masks: Tensor
    outcomes: Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.masks.dim() != 2 or self.masks.dtype != torch.bool:
            raise ValueError(f"masks must be [S, N] bool, got {self.masks.dtype} {tuple(self.masks.shape)}")
        if self.outcomes.dim() != 2 or self.outcomes.shape[0] != self.masks.shape[0]:
            raise ValueError(f"outcomes must be [S, Q] with S = {self.masks.shape[0]}, "
                             f"got {tuple(self.outcomes.shape)}")

    @property
    def num_subsets(self) -> int:
        return self.masks.shape[0]

    def head(self, num_subsets: int) -> GroundTruth:
        """The first ``num_subsets`` subsets (the same ones a smaller build would have drawn)."""
        if num_subsets > self.num_subsets:
            raise ValueError(f"{num_subsets} subsets asked, {self.num_subsets} held")
        return GroundTruth(self.masks[:num_subsets], self.outcomes[:num_subsets],
                           {**self.meta, "num_subsets": num_subsets})

    def save(self, path: str | Path) -> Path:
        """Write ``groundtruth.safetensors`` (metadata in its header) atomically, and ``meta.json`` beside it."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        meta = {**self.meta, "num_subsets": self.num_subsets}
        tmp = out / f".{_TENSORS}.{os.getpid()}.tmp"
        save_file({"masks": self.masks.to(torch.uint8).contiguous(), "outcomes": self.outcomes.contiguous()},
                  str(tmp), metadata={"meta": json.dumps(meta, sort_keys=True)})
        os.replace(tmp, out / _TENSORS)
        tmp_meta = out / f".{_META}.{os.getpid()}.tmp"
        tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp_meta, out / _META)
        return out

    @classmethod
    def load(cls, path: str | Path) -> GroundTruth:
        """Read a ground truth written by :meth:`save` (the metadata comes from the tensor file's header)."""
        from safetensors import safe_open

        file = Path(path) / _TENSORS
        if not file.exists():
            raise FileNotFoundError(f"no ground truth at {path} ({_TENSORS} missing)")
        with safe_open(str(file), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
            masks, outcomes = f.get_tensor("masks").to(torch.bool), f.get_tensor("outcomes")
        if meta.get("schema") != SCHEMA:
            raise StaleGroundTruth(f"{file}: schema {meta.get('schema')!r}, this version reads {SCHEMA}")
        return cls(masks, outcomes, meta)

    @staticmethod
    def exists(path: str | Path) -> bool:
        return (Path(path) / _TENSORS).exists()


def fingerprint(settings: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of the canonical JSON of ``settings``."""
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def subset_masks(num_train: int, num_subsets: int, fraction: float = 0.5, seed: int = 0) -> Tensor:
    """``[S, N]`` bool masks of random subsets of exactly ``round(fraction * N)`` examples, drawn one after
    another from a generator seeded by ``seed`` (so the first rows do not depend on ``num_subsets``)."""
    size = round(fraction * num_train)
    if not 0 < size < num_train:
        raise ValueError(f"fraction {fraction} of {num_train} examples gives subsets of {size}: need 0 < size < N")
    generator = torch.Generator().manual_seed(seed)
    masks = torch.zeros(num_subsets, num_train, dtype=torch.bool)
    for s in range(num_subsets):  # sequential draws keep the prefix stable
        masks[s, torch.randperm(num_train, generator=generator)[:size]] = True
    return masks


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<missing>"), new.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: cached {a!r}, now {b!r}")
    return out


def _outcome(outcome_fn: OutcomeFn, model: Any, expect: int | None, where: str) -> Tensor:
    values = outcome_fn(model)
    if not isinstance(values, Tensor) or values.dim() != 1:
        raise ValueError(f"outcome_fn must return a [Q] tensor, got {getattr(values, 'shape', type(values))} ({where})")
    if expect is not None and values.shape[0] != expect:
        raise ValueError(f"outcome_fn returned {values.shape[0]} outcomes, earlier {expect} ({where})")
    values = values.detach().to(torch.float64).cpu()
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"outcome_fn returned non-finite outcomes ({where}); the training diverged?")
    return values


def _bar(total: int, initial: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from ..common.progress import progress_bar

    return progress_bar(total=total, initial=initial, desc=desc, unit="model")


def build_lds_ground_truth(train_fn: TrainFn, outcome_fn: OutcomeFn, num_train: int, *,
                           cache: str | Path | None = None, config: dict[str, Any] | None = None,
                           options: LDSOptions | None = None) -> GroundTruth:
    """Retrain on random subsets and record the queries' outcomes (the LDS ground truth).

    Args:
        train_fn: ``train_fn(indices [m] long, seed) -> model``, trained on those training examples.
        outcome_fn: ``outcome_fn(model) -> [Q]``, the queries' ``-loss`` (higher = better).
        num_train: ``N``, the number of training examples.
        cache: a directory: a matching ground truth there is loaded (and extended if it holds fewer
            subsets), a build saves there as it goes.
        config: what the outcomes depend on besides ``num_train`` and the options (the task: data, model, training
            recipe), JSON-serialisable; required with ``cache`` -- it is how a stale cache is detected.
        options: how many subsets, their size, the seeds and runs (:class:`gradtrace.options.eval.LDSOptions`;
            default: its defaults, 100 subsets of half the data).

    Returns:
        :class:`GroundTruth` with ``masks [S, N]``, ``outcomes [S, Q]`` and ``meta``.

    Raises:
        StaleGroundTruth: the ground truth cached at ``cache`` was built for another configuration.
        ValueError: ``cache`` without ``config``; ``outcome_fn`` returned other than ``[Q]`` finite values.
    """
    options = LDSOptions() if options is None else options
    if not isinstance(options, LDSOptions):
        raise TypeError(f"options= must be an LDSOptions, got {type(options).__name__}")
    if cache is not None and config is None:
        raise ValueError("a cached ground truth needs config=... (the task's settings) to detect a stale cache")
    num_subsets, fraction, seed, runs = options.num_subsets, options.fraction, options.seed, options.runs
    seed_per_subset, subset_seed = options.seed_per_subset, options.subset_seed
    settings = {"kind": "lds", "schema": SCHEMA, "config": config, "num_train": num_train, "fraction": fraction,
                "seed": seed, "runs": runs, "seed_per_subset": seed_per_subset}
    if subset_seed is not None:  # absent otherwise: ground truths cached before it keep their fingerprint
        settings["subset_seed"] = subset_seed
    draws = seed if subset_seed is None else subset_seed
    key = fingerprint(settings)
    done_masks, done_outcomes, spent = None, None, 0.0
    if cache is not None and GroundTruth.exists(cache):
        held = GroundTruth.load(cache)
        if held.meta.get("fingerprint") != key:
            changes = _diff(held.meta.get("settings", {}), settings) or ["(fingerprint differs)"]
            raise StaleGroundTruth(f"the ground truth cached at {cache} was built for another configuration: "
                                   + "; ".join(changes) + ". Delete it or use another cache directory.")
        if held.num_subsets >= num_subsets:
            return held.head(num_subsets)
        done_masks, done_outcomes = held.masks, held.outcomes
        spent = float(held.meta.get("train_seconds", 0.0))
    masks = subset_masks(num_train, num_subsets, fraction, draws)
    start = 0
    if done_masks is not None:
        start = done_masks.shape[0]
        if not torch.equal(masks[:start], done_masks):
            raise StaleGroundTruth(f"the subsets cached at {cache} are not the ones seed {draws} draws")
    rows = list(done_outcomes) if done_outcomes is not None else []
    num_q = rows[0].shape[0] if rows else None
    meta = {"schema": SCHEMA, "fingerprint": key, "settings": settings, "subset_size": int(masks[0].sum()),
            "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads()}

    def result(count: int) -> GroundTruth:
        return GroundTruth(masks[:count], torch.stack(rows[:count]),
                           {**meta, "train_seconds": spent, "seconds_per_model": spent / max(1, count * runs)})

    bar = _bar(num_subsets, start, options.progress, "LDS ground truth")
    last_save = time.monotonic()
    try:
        for s in range(start, num_subsets):
            indices = masks[s].nonzero().flatten()
            total = None
            for r in range(runs):
                train_seed = seed + (s * runs + r if seed_per_subset else r)
                began = time.perf_counter()
                model = train_fn(indices, train_seed)
                values = _outcome(outcome_fn, model, num_q, f"subset {s}, run {r}")
                spent += time.perf_counter() - began
                num_q = values.shape[0]
                total = values if total is None else total + values
            rows.append(total / runs)
            if bar is not None:
                bar.update(1)
            if cache is not None and time.monotonic() - last_save >= options.save_every_s:
                result(len(rows)).save(cache)
                last_save = time.monotonic()
    finally:
        if bar is not None:
            bar.close()
        if cache is not None and len(rows) > start:  # keep finished work, also when interrupted
            result(len(rows)).save(cache)
    return result(num_subsets)


def build_loo_ground_truth(train_fn: TrainFn, outcome_fn: OutcomeFn, num_train: int, indices: Sequence[int] | Tensor,
                           seeds: Sequence[int] = (0,), progress: bool = False) -> Tensor:
    """Leave-one-out effects: ``effects[q, j]`` = outcome of query ``q`` trained on all data minus its outcome
    trained without example ``indices[j]``, averaged over ``seeds``.

    Outcomes are ``-loss``, so ``effects[q, j] > 0`` means removing the example raised the query's loss:
    the example helped, the sign of attribution scores. Costs ``len(seeds) * (len(indices) + 1)`` trainings.

    Returns:
        ``[Q, len(indices)]`` float64.
    """
    chosen = torch.as_tensor(indices, dtype=torch.long).flatten()
    if chosen.numel() == 0 or not len(seeds):
        raise ValueError("build_loo_ground_truth needs at least one index and one seed")
    if int(chosen.min()) < 0 or int(chosen.max()) >= num_train:
        raise ValueError(f"indices must lie in [0, {num_train})")
    everything = torch.arange(num_train)
    bar = _bar(len(seeds) * (chosen.numel() + 1), 0, progress, "LOO ground truth")
    total = None
    try:
        for seed in seeds:
            full = _outcome(outcome_fn, train_fn(everything, seed), None, f"all data, seed {seed}")
            if bar is not None:
                bar.update(1)
            effects = torch.empty(full.shape[0], chosen.numel(), dtype=torch.float64)
            for j, i in enumerate(chosen.tolist()):
                kept = torch.cat([everything[:i], everything[i + 1:]])
                effects[:, j] = full - _outcome(outcome_fn, train_fn(kept, seed), full.shape[0],
                                                f"without example {i}, seed {seed}")
                if bar is not None:
                    bar.update(1)
            total = effects if total is None else total + effects
    finally:
        if bar is not None:
            bar.close()
    return total / len(seeds)

