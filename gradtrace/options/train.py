"""How the training-time callbacks act on a loop: SAMA reweighting and online data selection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..common.checks import Range, check_fields
from .base import _choice

SELECTION_RULES = ("negative", "bottom", "threshold")


@dataclass(frozen=True, kw_only=True)
class ReweightingOptions:
    """How SAMA learns its weights (see :class:`gradtrace.train.SAMAReweighting`).

    Attributes:
        meta_lr: learning rate of the logits (Adam; > 0: a negative one would climb the meta loss).
        alpha: finite-difference scale, ``eps = alpha / |v|`` (> 0).
        interval: run a meta step every ``interval`` optimizer steps (>= 1).
        start_step: optimizer steps to train before the first meta step (>= 0; the weights stay at ``init_logit``).
        init_logit: the logit every example (or source) starts at (its weight: ``sigmoid(init_logit)``).
        id_key: where a dict batch holds its example ids (else ``ids=`` must be given to ``loss``).
        normalize: divide the weighted loss by the mean weight of the batch (weights then only reallocate).
    """

    meta_lr: float = field(default=0.1, metadata={"min": 0, "min_open": True})
    alpha: float = field(default=0.01, metadata={"min": 0, "min_open": True})
    interval: int = field(default=1, metadata={"min": 1})
    start_step: int = field(default=0, metadata={"min": 0})
    init_logit: float = field(default=0.0, metadata={"valid": Range(float)})
    id_key: str = "id"
    normalize: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


THRESHOLD = Range(float, low=-math.inf, finite=False, label="a number, not NaN (+-inf keeps or drops every example)")
"""A selection threshold: +-inf is allowed (keep or drop every example), NaN compares false with every score."""


@dataclass(frozen=True, kw_only=True)
class SelectionOptions:
    """Which examples online selection drops, and how it edits ``param.grad`` (see
    :class:`gradtrace.train.OnlineSelection`).

    Attributes:
        rule: ``"negative"`` (drop score < 0), ``"bottom"`` (drop the lowest ``fraction`` of the step's examples)
            or ``"threshold"`` (drop score < ``threshold``).
        fraction: the share dropped by ``rule="bottom"`` (in [0, 1]; required by it, refused by the other rules).
        threshold: the score below which ``rule="threshold"`` drops (a number, not NaN; required by it, refused by
            the other rules).
        normalize: score by cosine similarity (``<g_e, target> / (|g_e| |target|)``) instead of the inner product,
            so that examples with large gradients (high loss) do not dominate the ranking; the sign, and so the
            ``"negative"`` rule, is unchanged.
        renormalize: rescale ``param.grad`` to the mean over the kept examples (for a mean-reduced loop loss).
        min_keep: examples always kept per step (>= 0; across ranks under DDP).
        start_step: optimizer steps to leave alone before selecting (>= 0; early in training, while a model learns
            token frequencies or class priors, even corrupted examples can point along the target).
        record_scores: keep every example's score in the log (``history``).
        ddp: all-reduce the dropped contributions across ranks (None: when a process group is initialised).
    """

    rule: str = "negative"
    fraction: float | None = field(default=None, metadata={"min": 0, "max": 1})
    threshold: float | None = field(default=None, metadata={"valid": THRESHOLD})
    normalize: bool = False
    renormalize: bool = False
    min_keep: int = field(default=1, metadata={"min": 0})
    start_step: int = field(default=0, metadata={"min": 0})
    record_scores: bool = False
    ddp: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        _choice(self.rule, "rule", SELECTION_RULES)
        for name, rule in (("fraction", "bottom"), ("threshold", "threshold")):
            given = getattr(self, name) is not None
            if given != (self.rule == rule):
                raise ValueError(f"rule={rule!r} needs {name}=" if not given else
                                 f"{name}= applies to rule={rule!r} only, not rule={self.rule!r}")
