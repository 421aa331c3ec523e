"""The report's header: what produced the scores (method, projection, model) and how much of the model the training
gradients cover -- the share of trainable parameters the training store captured, read from ``Scores.meta``
(``meta["coverage"]``) or the manifest of the store the scores record (``meta["config"]["store"]``, as
``gradtrace score`` writes it), with a warning when it is below 100%."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..capture.coverage import Coverage, recorded_coverage

__all__ = ["coverage_warning", "header_rows", "projection_label", "training_coverage", "units_line"]


def projection_label(spec: Mapping[str, Any] | None) -> str:
    if not spec:
        return "none (exact gradients)"
    if spec.get("kind") == "logra":
        return (f"LoGra rank {spec.get('rank_rows')}x{spec.get('rank_cols')} (vectors {spec.get('vector_rank')}), "
                f"seed {spec.get('seed')}")
    return ", ".join(f"{k} {v}" for k, v in spec.items())


def header_rows(scores: Any) -> list[tuple[str, str]]:
    """The report header's ``(key, value)`` rows: method, projection, model fingerprint, the members of an ensemble,
    and the share of trainable parameters the training store captured (where recorded)."""
    meta, spec = scores.meta, scores.meta.get("spec") or {}
    options = meta.get("options") or {}
    method = scores.method + (" (" + ", ".join(f"{k} {v}" for k, v in options.items()) + ")" if options else "")
    model = spec.get("model") or {}
    fingerprint = (f"{model.get('class', '?')}, architecture {model.get('arch', '?')}, weights "
                   f"{model.get('weights', '?')}") if model else "not recorded"
    first = " (first member)" if scores.combination else ""
    rows = [("method", method), ("projection", projection_label(spec.get("projection")) if spec else "not recorded"),
            ("model" + first, fingerprint)]
    combination = scores.combination
    if combination:  # the fingerprint above is then the first member's; the models the command used follow
        rows.append(("combines", combination))
        models = (meta.get("config") or {}).get("model")
        if isinstance(models, list) and len(models) > 1:
            rows.append(("models", ", ".join(_distinct_names([str(m) for m in models]))))
    replay = meta.get("metagradients")
    if isinstance(replay, dict):  # gradtrace metagrad: exact derivatives through a recorded run, no projection
        rows = [rows[0], ("projection", "none (exact derivatives through the recorded run)"),
                ("run", _run_line(replay))]
    coverage = training_coverage(scores.meta)
    if coverage is not None:
        rows.append(("coverage", coverage.line()))
    return rows


def _run_line(replay: Mapping[str, Any]) -> str:
    """The recorded run metagradients went through, and the steps their reverse pass covered."""
    steps = replay.get("steps")
    start = (replay.get("options") or {}).get("start_step") or 0
    covered = (f"steps {start:,}..{steps - 1:,} of {steps:,} differentiated (a truncated pass: the earlier steps' "
               "weights are not)" if start and isinstance(steps, int) else
               f"all {steps:,} steps differentiated" if isinstance(steps, int) else "steps not recorded")
    difference = replay.get("replay_difference")
    return (f"{replay.get('run_dir', '?')}: {covered}"
            + (f"; replay difference {difference:.2e}" if isinstance(difference, (int, float)) else ""))


def _distinct_names(paths: list[str]) -> list[str]:
    """Each path relative to the folder all of them share (``checkpoint-500``, ``run1/final``)."""
    try:
        common = os.path.commonpath(paths)
    except ValueError:  # relative and absolute mixed, or other drives
        return paths
    return [os.path.relpath(p, common) if p != common else os.path.basename(p) for p in paths]


def units_line(scores: Any) -> str:
    """What the scores are (``Scores.units``: an ensemble's are normalised ensemble scores, not the method's)."""
    return f"{scores.units}. Compare scores within one report: their scale depends on the method."


def training_coverage(meta: Mapping[str, Any]) -> Coverage | None:
    """The coverage of the training gradients the scores were computed from: ``meta["coverage"]``, else that of the
    store(s) ``meta["config"]["store"]`` names (of several, the lowest share); None where none is recorded."""
    if isinstance(meta.get("coverage"), dict):
        return Coverage.from_dict(meta["coverage"])
    stores = (meta.get("config") or {}).get("store")
    found = []
    for store in stores if isinstance(stores, list) else [stores] if stores else []:
        try:
            coverage = recorded_coverage(json.loads((Path(store) / "manifest.json").read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if coverage is not None:
            found.append(coverage)
    return min(found, key=lambda c: c.share) if found else None


def coverage_warning(scores: Any) -> list[str]:
    """A warning when the training gradients leave trainable parameters out (none at 100% or unrecorded)."""
    coverage = training_coverage(scores.meta)
    if coverage is None or coverage.captured >= coverage.trainable:
        return []
    return [f"the training gradients cover only {coverage.line()}: the scores ignore what the left-out parameters "
            "contribute"]
