"""What a capture covers, what it leaves out and why: :class:`CaptureReport` (printable) and :class:`Coverage`, the
share of the trainable parameters captured per example.

Coverage is never silent. A trainable parameter that will not be captured per example -- a module no rule covers
(found at selection), a call whose rows cannot be matched to examples (found while running), a parameter used
outside its module's forward (functional use, found at a backward pass) -- stops the capture with a
:class:`CoverageError` naming it, why, the share captured and the fixes (``exclude=[...]``, freezing it, or
``partial=True``). Parameters the user left out (``layers`` / ``exclude``, ``broadcast="skip"``) are no error but
count in the share ("excluded by you"); frozen parameters are not trainable and are not counted.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..common.modules import canonical_param_names, strip_wrappers, unwrap
from ..options.base import RECORD_KEY
from .layer_selection import Selection, Unsupported

__all__ = ["CaptureReport", "Coverage", "CoverageError", "LeftOut", "coverage_of", "enforce", "exclude_patterns",
           "record_coverage", "recorded_coverage", "uncovered_message"]

REASONS = {"unsupported": "unsupported", "runtime": "left out while running", "functional": "functional use",
           "excluded": "excluded by you"}
"""Why a trainable parameter is left out (the key), and how it is shown."""
SHOWN = 6  # parameters (and modules) named in an error or a line before "and N more"
RECORDED = 100  # left-out parameters listed in a store's manifest (the counts cover all of them)


class CoverageError(ValueError):
    """Trainable parameters that will not be captured per example, without ``CaptureOptions(partial=True)``.

    ``coverage``: the :class:`Coverage` found; ``when``: where it was found (selection, running, backward)."""

    def __init__(self, coverage: Coverage, when: str = "") -> None:
        super().__init__(uncovered_message(coverage, when))
        self.coverage = coverage
        self.when = when


@dataclass(frozen=True)
class LeftOut:
    """A trainable parameter not captured per example: its canonical ``name``, the ``module`` holding it (what
    ``exclude`` names), ``reason`` (a key of :data:`REASONS`), ``detail`` (why) and its element count ``numel``."""

    name: str
    module: str
    reason: str
    detail: str
    numel: int


@dataclass
class Coverage:
    """The share of the trainable parameters a capture takes per example (tied parameters counted once).

    captured / trainable: elements of the trainable parameters captured / of all trainable parameters.
    captured_params / trainable_params: the same counted in parameter tensors.
    partial: the capture was allowed to leave trainable parameters out (``CaptureOptions(partial=True)``).
    left_out: the trainable parameters not captured, with why (a stored one lists the first :data:`RECORDED`;
        ``left_out_total`` counts all of them). exclude_fix: the ``exclude`` entries that would leave the
        uncapturable ones out on purpose (module names, or globs matching only such modules).
    """

    captured: int
    trainable: int
    captured_params: int
    trainable_params: int
    partial: bool = False
    left_out: list[LeftOut] = field(default_factory=list)
    left_out_total: int | None = None
    exclude_fix: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        """``captured / trainable`` (1.0 when nothing is trainable)."""
        return self.captured / self.trainable if self.trainable else 1.0

    @property
    def uncovered(self) -> list[LeftOut]:
        """The left-out parameters the user did not leave out on purpose (an error unless ``partial``)."""
        return [entry for entry in self.left_out if entry.reason != "excluded"]

    @property
    def percent(self) -> str:
        """The share as ``97.3%`` (rounded down: a capture missing anything never shows 100.0%)."""
        value = math.floor(self.share * 1000) / 10
        if self.captured < self.trainable:
            value = min(value, 99.9)
        return f"{value:.1f}%"

    def line(self) -> str:
        """``97.3% of trainable parameters (1,024 of 1,052 elements); left out: conv (unsupported), ...``."""
        text = f"{self.percent} of trainable parameters ({self.captured:,} of {self.trainable:,} elements)"
        if not self.left_out:
            return text
        modules: dict[tuple[str, str], None] = {}
        for entry in self.left_out:
            modules.setdefault((entry.module or entry.name, REASONS.get(entry.reason, entry.reason)))
        shown = [f"{module} ({why})" for module, why in list(modules)[:SHOWN]]
        more = len(modules) - SHOWN
        total = self.left_out_total if self.left_out_total is not None else len(self.left_out)
        tail = f" and {more} more module(s)" if more > 0 else ""
        if total > len(self.left_out):
            tail += f" ({total:,} parameters in all)"
        return f"{text}; left out: {', '.join(shown)}{tail}"

    def to_dict(self, limit: int = RECORDED) -> dict[str, Any]:
        """The JSON form recorded in a store's manifest (``config["gradtrace"]["coverage"]``)."""
        counts: dict[str, int] = {}
        for entry in self.left_out:
            counts[entry.reason] = counts.get(entry.reason, 0) + 1
        return {"share": self.share, "captured": self.captured, "trainable": self.trainable,
                "captured_params": self.captured_params, "trainable_params": self.trainable_params,
                "partial": self.partial, "left_out_total": len(self.left_out), "left_out_by_reason": counts,
                "left_out": [{"name": e.name, "module": e.module, "reason": e.reason, "detail": e.detail[:200],
                              "numel": e.numel} for e in self.left_out[:limit]]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coverage:
        left = [LeftOut(str(e.get("name", "")), str(e.get("module", "")), str(e.get("reason", "")),
                        str(e.get("detail", "")), int(e.get("numel", 0))) for e in data.get("left_out") or []]
        return cls(captured=int(data.get("captured", 0)), trainable=int(data.get("trainable", 0)),
                   captured_params=int(data.get("captured_params", 0)),
                   trainable_params=int(data.get("trainable_params", 0)), partial=bool(data.get("partial", False)),
                   left_out=left, left_out_total=int(data.get("left_out_total", len(left))))


def coverage_of(model: nn.Module, selection: Selection, report: CaptureReport, partial: bool = False) -> Coverage:
    """The :class:`Coverage` of a capture of ``model``: what ``selection`` takes, less what ``report`` says was
    left out while running (runtime skips, functional use)."""
    inner = unwrap(model)
    names = canonical_param_names(inner)
    module_of = {param: module for module, _, params in report.layers for param in params}
    runtime = {param: (module, reason) for module, _, params in report.layers
               if (reason := report.runtime_skipped.get(module)) is not None for param in params}
    unsupported = {param: u for u in selection.unsupported for param in u.params}
    functional = set(report.functional)
    captured_names = set(selection.param_order)
    captured = trainable = captured_params = trainable_params = 0
    left: list[LeftOut] = []
    for param in dict.fromkeys(p for p in inner.parameters()):  # tied parameters once
        if not param.requires_grad:
            continue
        name, numel = names[id(param)], param.numel()
        trainable += numel
        trainable_params += 1
        owner = module_of.get(name, name.rpartition(".")[0])
        if name in functional:
            left.append(LeftOut(name, owner, "functional", "it received gradients no hook of its module saw (used "
                                "outside the module's forward: a fused kernel, F.linear on its weight)", numel))
        elif name in runtime:
            module, reason = runtime[name]
            kind = "excluded" if module in report.chosen else "runtime"
            left.append(LeftOut(name, module, kind, reason, numel))
        elif name in captured_names:
            captured += numel
            captured_params += 1
        elif name in unsupported:
            u = unsupported[name]
            left.append(LeftOut(name, u.module, "unsupported", f"{u.type_name}: {u.reason}", numel))
        else:
            left.append(LeftOut(name, owner, "excluded", "not selected by layers= / exclude=", numel))
    modules = [strip_wrappers(n) for n, _ in inner.named_modules()]
    return Coverage(captured, trainable, captured_params, trainable_params, partial, left,
                    exclude_fix=exclude_patterns([e.module for e in left if e.reason != "excluded"], modules))


def exclude_patterns(left: Iterable[str], modules: list[str]) -> list[str]:
    """``exclude`` entries leaving out exactly the modules ``left``: their names, with a numbered block
    (``model.layers.3.mixer``) turned into a glob (``model.layers.*.mixer``) where it matches several of them and
    no other module."""
    wanted = list(dict.fromkeys(m for m in left if m))
    patterns: list[str] = []
    for module in wanted:
        parts = module.split(".")
        best, most = module, 1
        for i, part in enumerate(parts):
            if not part.isdigit():
                continue
            glob = ".".join([*parts[:i], "*", *parts[i + 1:]])
            matched = [m for m in modules if fnmatch.fnmatchcase(m, glob)]
            if len(matched) > most and all(m in wanted for m in matched):
                best, most = glob, len(matched)
        if best not in patterns:
            patterns.append(best)
    return patterns


def uncovered_message(coverage: Coverage, when: str = "", *, cli: bool = False) -> str:
    """The error for trainable parameters that will not be captured: which, why, the share, and the fixes (worded
    for the command line with ``cli``)."""
    missing = coverage.uncovered
    groups: dict[tuple[str, str], list[str]] = {}
    for entry in missing:
        groups.setdefault((entry.module, entry.detail), []).append(entry.name)
    shown, listed = [], 0
    for (module, detail), params in groups.items():
        if listed >= SHOWN:
            break
        names = params[:SHOWN - listed]
        listed += len(names)
        shown.append(f"{', '.join(names)} in {module or 'the model'} ({detail})")
    more = f"; and {len(missing) - listed} more" if len(missing) > listed else ""
    fix = coverage.exclude_fix
    if cli:
        todo = (f"leave them out on purpose with {' '.join(f'--exclude {p}' for p in fix)}, freeze them, or accept a "
                "partial capture with --partial (the store records the share captured)")
    else:
        todo = (f"leave them out on purpose with CaptureOptions(exclude={fix!r}) (command line: "
                f"{' '.join(f'--exclude {p}' for p in fix)}), freeze them (requires_grad=False), or accept a partial "
                "capture with CaptureOptions(partial=True) (command line: --partial; a store records the share)")
    prefix = "" if cli else "gradtrace: "
    return (f"{prefix}{len(missing)} trainable parameter(s) cannot be captured per example{when}: "
            f"{'; '.join(shown)}{more}. Only {coverage.percent} of the trainable parameters "
            f"({coverage.captured:,} of {coverage.trainable:,} elements) would be captured. To go on, {todo}")


def enforce(coverage: Coverage, when: str = "") -> None:
    """Raise :class:`CoverageError` when ``coverage`` leaves trainable parameters out that the user did not
    (unless it is ``partial``)."""
    if not coverage.partial and coverage.uncovered:
        raise CoverageError(coverage, when)


def record_coverage(config: dict[str, Any] | None, coverage: Coverage) -> dict[str, Any]:
    """``config`` (not modified) with ``coverage`` recorded as ``config["gradtrace"]["coverage"]``."""
    out = dict(config or {})
    out[RECORD_KEY] = {**(out.get(RECORD_KEY) or {}), "coverage": coverage.to_dict()}
    return out


def recorded_coverage(manifest: dict[str, Any]) -> Coverage | None:
    """The coverage a store's manifest records (None for a store written before coverage was recorded)."""
    block = ((manifest.get("config") or {}).get(RECORD_KEY) or {}) if isinstance(manifest, dict) else {}
    data = block.get("coverage") if isinstance(block, dict) else None
    return Coverage.from_dict(data) if isinstance(data, dict) else None


@dataclass
class CaptureReport:
    """Printable summary of a capture's coverage.

    layers: ``(module name, kind, captured parameter names)`` per captured module.
    unsupported: trainable parameters that cannot be captured per example (left out).
    frozen: supported modules skipped because their parameters are frozen.
    tied: modules added because they share a captured parameter.
    broadcast: layers whose batch-shared output was expanded to per-example rows.
    runtime_skipped: ``module -> reason`` for calls left out while running.
    chosen: those of ``runtime_skipped`` the options asked for (``broadcast="skip"``): excluded by the user.
    functional: parameters that received gradients no hook saw (functional use).
    coverage: the share of the trainable parameters captured (set by ``Capture.report()``).
    """

    layers: list[tuple[str, str, list[str]]] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    broadcast: list[str] = field(default_factory=list)
    runtime_skipped: dict[str, str] = field(default_factory=dict)
    functional: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    num_backward: int = 0
    chosen: dict[str, str] = field(default_factory=dict)
    coverage: Coverage | None = None

    @classmethod
    def from_selection(cls, selection: Selection) -> CaptureReport:
        layers = [(h.name, h.describe(), list(h.params.values())) for h in selection.handlers]
        return cls(layers=layers, unsupported=list(selection.unsupported), frozen=list(selection.frozen),
                   tied=list(selection.tied))

    @property
    def ok(self) -> bool:
        """True when every trainable parameter seen is captured per example."""
        return not (self.unsupported or self.runtime_skipped or self.functional)

    def note_broadcast(self, name: str) -> None:
        if name not in self.broadcast:
            self.broadcast.append(name)

    def skip_runtime(self, name: str, reason: str, *, chosen: bool = False) -> bool:
        """Record that calls of module ``name`` are left out (``chosen``: as the options asked); True the first
        time (the capture then checks its coverage and warns)."""
        if name in self.runtime_skipped:
            return False
        self.runtime_skipped[name] = reason
        if chosen:
            self.chosen[name] = reason
        return True

    def runtime_params(self) -> set[str]:
        """The captured parameters of the modules left out while running (their gradients are not all captured)."""
        return {param for module, _, params in self.layers if module in self.runtime_skipped for param in params}

    def note_functional(self, names: list[str]) -> None:
        for name in names:
            if name not in self.functional:
                self.functional.append(name)

    def __str__(self) -> str:
        params = sum(len(p) for _, _, p in self.layers)
        lines = [f"gradtrace capture: {len(self.layers)} modules, {params} parameters captured, "
                 f"{self.num_backward} backward passes"]
        if self.coverage is not None:
            allowed = " (partial capture allowed)" if self.coverage.partial else ""
            lines.append(f"coverage{allowed}: {self.coverage.line()}")
        width = max((len(n) for n, _, _ in self.layers), default=10)
        for name, kind, names in self.layers:
            lines.append(f"  {name:<{width}}  {kind:<16} {', '.join(names)}")
        if self.tied:
            lines.append("tied (captured at every use site):")
            lines += [f"  {t}" for t in self.tied]
        if self.broadcast:
            lines.append("batch-shared outputs expanded per example: " + ", ".join(self.broadcast))
        if self.frozen:
            lines.append(f"frozen, skipped: {len(self.frozen)} modules")
        if self.unsupported:
            lines.append("NOT captured (trainable, no per-example rule):")
            lines += [f"  {u.module} ({u.type_name}) {', '.join(u.params)}: {u.reason}" for u in self.unsupported]
        if self.runtime_skipped:
            lines.append("NOT captured while running:")
            lines += [f"  {n}: {r}" for n, r in self.runtime_skipped.items()]
        if self.functional:
            lines.append("received gradients no hook saw (functional use): " + ", ".join(self.functional))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__
