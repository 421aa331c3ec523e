"""``CaptureReport``: what a capture covers, what it leaves out, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

from .layer_selection import Selection, Unsupported

__all__ = ["CaptureReport"]


@dataclass
class CaptureReport:
    """Printable summary of a capture's coverage.

    layers: ``(module name, kind, captured parameter names)`` per captured module.
    unsupported: trainable parameters that cannot be captured per example (left out).
    frozen: supported modules skipped because their parameters are frozen.
    tied: modules added because they share a captured parameter.
    broadcast: layers whose batch-shared output was expanded to per-example rows.
    runtime_skipped: ``module -> reason`` for calls left out while running.
    functional: parameters that received gradients no hook saw (functional use).
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

    def skip_runtime(self, name: str, reason: str) -> None:
        if name not in self.runtime_skipped:
            import warnings

            warnings.warn(f"gradtrace: {name} is left out: {reason}", stacklevel=3)
            self.runtime_skipped[name] = reason

    def note_functional(self, names: list[str]) -> None:
        for name in names:
            if name not in self.functional:
                self.functional.append(name)

    def __str__(self) -> str:
        params = sum(len(p) for _, _, p in self.layers)
        lines = [f"gradtrace capture: {len(self.layers)} modules, {params} parameters captured, "
                 f"{self.num_backward} backward passes"]
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
