"""``evaluate``: the LDS of attribution methods on a task, against a retraining ground truth.

A method is a registered name, its options, and whether it must be fitted first
(``Attributor.fit(model, train_batches, loss_fn, **fit_options)``, e.g. curvature methods); ``"random"``
is a built-in baseline of independent standard-normal scores (fixed seed), whose LDS should be near 0.
Per-example gradients of the training examples and queries are collected once, at the task's model
trained on all the data, with the task's per-example loss, and shared by all methods.

``MethodSpec(name, ensemble="checkpoints" | "seeds", members=C)`` scores the method as an ensemble
(:class:`gradtrace.Ensemble`, each member's scores divided by their mean absolute value, equal weights) over
``C`` models: the task's training run saved at ``C`` evenly spaced epochs, the last being the task's model
(:meth:`Task.checkpoints`), or ``C`` models trained on all the data with seeds ``seed, seed + 1, ...`` (the first
being the task's model); ``ensemble="late_checkpoints"`` takes the ``C`` checkpoints evenly spaced over the second
half of the run instead (``Task.checkpoints(C, after=0.5)``). Each member's gradients are collected and its method
fitted at its own weights; the ground truth is unchanged. With ``unrolled={"steps": [...], "lr": ..., "optimizers":
...}`` a checkpoint ensemble of a curvature method is combined by the training dynamics instead
(:class:`gradtrace.Unrolled`: each segment's steps and learning rate, each checkpoint's optimizer state or
``"sgd"``), scoring the query gradients of the last member (the task's model).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..capture.collect import collect
from ..fit.methods import available_methods, get_method
from ..options import CaptureOptions, RunOptions
from ..projection.logra import LoGra
from ..score import Attributor, Ensemble, Unrolled
from .groundtruth import GroundTruth
from .metrics import QueryMetric, lds
from .tasks.base import Task

__all__ = ["CHECKPOINTS_AFTER", "ENSEMBLES", "INHERIT", "RANDOM", "MethodSpec", "Row", "ensemble_models", "evaluate",
           "format_table", "unsupported"]

RANDOM = "random"


INHERIT = "inherit"

ENSEMBLES = ("checkpoints", "late_checkpoints", "seeds")
"""The ensembles a :class:`MethodSpec` can ask for (see the module docstring)."""
CHECKPOINTS_AFTER = {"checkpoints": 0.0, "late_checkpoints": 0.5}
"""The checkpoint ensembles: where in the run their checkpoints start (``Task.checkpoints``' ``after``)."""


@dataclass(frozen=True)
class MethodSpec:
    """A method to evaluate.

    name: a registered method name or ``"random"``. options: passed to the method (``Attributor(name,
    train, **options)``). fit: call ``Attributor.fit(model, train_batches, loss_fn, **fit_options)`` before
    scoring; None = when the method defines ``fit``. projection: the gradients this method scores
    (``gradtrace.LoGra(...)``, or None for exact ones); default: the projection given to :func:`evaluate`.
    label: the row's name (default: the name, with options). ensemble: None (the task's model), or one of
    :data:`ENSEMBLES` over ``members`` models (see the module docstring). member_options: for an ensemble, one dict
    of fit options per member (:meth:`gradtrace.Ensemble.fit`'s ``member_options``, e.g. each member's Adam state).
    unrolled: for a checkpoint ensemble, combine it with :class:`gradtrace.Unrolled`: ``{"steps": [...], "lr": ...,
    "optimizers": ...}`` (see the module docstring).
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    fit: bool | None = None
    fit_options: dict[str, Any] = field(default_factory=dict)
    projection: LoGra | str | None = INHERIT
    label: str | None = None
    ensemble: str | None = None
    members: int = 6
    member_options: list[dict[str, Any]] | None = None
    unrolled: dict[str, Any] | None = None

    @classmethod
    def parse(cls, item: str | tuple[str, dict[str, Any]] | MethodSpec) -> MethodSpec:
        """A spec from a name, a ``(name, options)`` pair or a spec."""
        if isinstance(item, MethodSpec):
            return item
        if isinstance(item, str):
            return cls(item)
        name, options = item
        return cls(name, dict(options))

    @property
    def title(self) -> str:
        if self.label:
            return self.label
        if not self.options:
            return self.name
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in sorted(self.options.items())) + ")"


@dataclass
class Row:
    """One method's result: ``lds_mean`` ± ``lds_se`` (standard error over queries, ``std / sqrt(Q)``);
    ``seconds``: the method's own time (fit + score), not counting the gradient collection it shares with
    other methods (``collect_seconds``); ``lds``: the per-query values; ``dim``: the gradient dimension;
    ``members_seconds``: for an ensemble, the training of its members (shared by the methods that use them)."""

    method: str
    lds_mean: float
    lds_se: float
    seconds: float
    collect_seconds: float = 0.0
    lds: QueryMetric | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dim: int = 0
    members_seconds: float = 0.0


def unsupported(name: str) -> str | None:
    """Why the harness cannot evaluate method ``name`` (None when it can)."""
    if name == RANDOM:
        return None
    if name not in available_methods():
        return f"unknown method (available: {', '.join(available_methods())})"
    try:
        method = get_method(name)
    except TypeError:  # needs options to be built: nothing more to check here
        return None
    if method.multi_checkpoint:
        return "needs gradients at several training checkpoints; the tasks attribute one final model"
    fit = method.fit if method.has_fit() else None
    if fit is not None and "model" not in _parameters(fit):
        stages = ", ".join(method.needs) or "its fit"
        return (f"needs a recorded training trajectory ({stages}; its fit() takes no model or data); the tasks "
                "attribute one final model")
    return None


def _parameters(fn: Any) -> dict[str, Any]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _fit_kwargs(fit: Any, projection: LoGra | None, fit_options: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(fit_options)
    if projection is not None and "projection" not in kwargs and "projection" in _parameters(fit):
        kwargs["projection"] = projection
    return kwargs


class _Gradients:
    """Training and query gradients of a task's model, collected once per projection."""

    def __init__(self, task: Task, batch_size: int, progress: bool) -> None:
        self.task, self.batch_size, self.progress = task, batch_size, progress
        self.held: list[tuple[LoGra | None, Any, Any, float]] = []

    def get(self, projection: LoGra | None) -> tuple[Any, Any, float]:
        for known, train, queries, seconds in self.held:
            # to_dict(): LoGra's equality ignores a PCA basis, its spec carries the basis's fingerprint
            if known is projection or (known is not None and projection is not None
                                       and known.to_dict() == projection.to_dict()):
                return train, queries, seconds
        task, model = self.task, self.task.model
        began = time.perf_counter()
        train = collect(model, task.train_batches(self.batch_size), task.loss_fn,
                        options=CaptureOptions(projection=projection), run=RunOptions(progress=self.progress))
        queries = collect(model, task.query_batches(), task.loss_fn, options=CaptureOptions(projection=projection))
        seconds = time.perf_counter() - began
        if list(train.ids) != task.train_ids or list(queries.ids) != task.query_ids:
            raise RuntimeError("the collected gradients do not cover the task's examples in order (non-finite "
                               "gradients dropped?)")
        self.held.append((projection, train, queries, seconds))
        return train, queries, seconds


def ensemble_models(task: Task, kind: str, count: int) -> list[torch.nn.Module]:
    """The ``count`` models of an ensemble of ``kind`` (:data:`ENSEMBLES`; see the module docstring)."""
    if kind in CHECKPOINTS_AFTER:
        return task.checkpoints(count, after=CHECKPOINTS_AFTER[kind])
    if kind == "seeds":
        everything = torch.arange(task.num_train)
        return [task.model] + [task.train(everything, task.settings.seed + s) for s in range(1, count)]
    raise ValueError(f"ensemble must be one of {ENSEMBLES}, got {kind!r}")


class _Members:
    """The models of each ensemble (trained once) and their training and query gradients, collected once per
    projection, shared by every method that uses them."""

    def __init__(self, task: Task, batch_size: int, progress: bool) -> None:
        self.task, self.batch_size, self.progress = task, batch_size, progress
        self.models: dict[tuple[str, int], tuple[list[torch.nn.Module], float]] = {}
        self.held: dict[tuple[str, int, str], tuple[list[Any], list[Any], float]] = {}

    def get(self, kind: str, count: int, projection: LoGra | None
            ) -> tuple[list[torch.nn.Module], list[Any], list[Any], float, float]:
        """``(models, training gradients, query gradients, collect seconds, training seconds)``, one per member."""
        if (kind, count) not in self.models:
            began = time.perf_counter()
            models = ensemble_models(self.task, kind, count)
            self.models[kind, count] = (models, time.perf_counter() - began)
        models, train_seconds = self.models[kind, count]
        key = (kind, count, repr(None if projection is None else projection.to_dict()))
        if key not in self.held:
            task, began = self.task, time.perf_counter()
            trains = [collect(m, task.train_batches(self.batch_size), task.loss_fn,
                              options=CaptureOptions(projection=projection),
                              run=RunOptions(progress=self.progress)) for m in models]
            queries = [collect(m, task.query_batches(), task.loss_fn,
                               options=CaptureOptions(projection=projection)) for m in models]
            self.held[key] = (trains, queries, time.perf_counter() - began)
        trains, queries, seconds = self.held[key]
        return models, trains, queries, seconds, train_seconds


def _score_ensemble(spec: MethodSpec, task: Task, models: list[torch.nn.Module], trains: list[Any],
                    queries: list[Any], projection: LoGra | None, batch_size: int) -> Tensor:
    """The ensemble's ``[Q, N]`` scores, each member fitted at its own model when the method is fitted."""
    ensemble = Ensemble(spec.name, trains, **spec.options)
    fit = getattr(ensemble.method, "fit", None)
    if spec.fit if spec.fit is not None else callable(fit):
        ensemble.fit(None, task.train_batches(batch_size), task.loss_fn, models=models,
                     member_options=spec.member_options, **_fit_kwargs(fit, projection, spec.fit_options))
    return ensemble.score(queries, topk=None, matrix=True).matrix


def _score_unrolled(spec: MethodSpec, task: Task, models: list[torch.nn.Module], trains: list[Any],
                    queries: list[Any], projection: LoGra | None, batch_size: int) -> Tensor:
    """The ``[Q, N]`` scores of the checkpoints combined by :class:`gradtrace.Unrolled`, fitted at each member."""
    settings = dict(spec.unrolled)
    optimizers = settings.pop("optimizers")
    unrolled = Unrolled(spec.name, trains, **settings, **spec.options)
    fit_options = _fit_kwargs(unrolled.method.fit, projection, spec.fit_options)
    unrolled.fit(None, task.train_batches(batch_size), task.loss_fn, models=models, optimizers=optimizers,
                 **fit_options)
    return unrolled.score(queries[-1], topk=None, matrix=True).matrix


def evaluate(task: Task, methods: Sequence[str | tuple[str, dict[str, Any]] | MethodSpec],
             ground_truth: GroundTruth, projection: LoGra | None = None, *, batch_size: int = 64,
             seed: int = 0, progress: bool = False) -> list[Row]:
    """LDS of each method on ``task`` against ``ground_truth``.

    Args:
        task: the task; its ``model`` (trained on all data) is the one attributed.
        methods: names, ``(name, options)`` pairs or :class:`MethodSpec` s; ``"random"`` for the baseline.
        ground_truth: LDS ground truth of this task (``masks [S, N]``, ``outcomes [S, Q]``), e.g. from
            ``build_lds_ground_truth(task.train, task.outcome, task.num_train, config=task.config)``;
            refused when its metadata names another task configuration.
        projection: collect projected gradients (``gradtrace.LoGra(rank=...)``) for the methods whose
            spec does not choose; passed to a method's ``fit`` when that takes ``projection``.
        batch_size: examples per batch when collecting gradients and fitting.
        seed: seed of the random baseline.
        progress: progress bars while collecting.

    Returns:
        One :class:`Row` per method, in order.
    """
    specs = [MethodSpec.parse(m) for m in methods]
    for spec in specs:
        reason = unsupported(spec.name)
        if reason is not None:
            raise ValueError(f"cannot evaluate {spec.name!r}: {reason}")
        if spec.ensemble is not None and (spec.ensemble not in ENSEMBLES or spec.name == RANDOM):
            raise ValueError(f"cannot evaluate {spec.title!r} as an ensemble {spec.ensemble!r}: ensembles are "
                             f"{ENSEMBLES} of a registered method")
        if spec.unrolled is not None and spec.ensemble not in CHECKPOINTS_AFTER:
            raise ValueError(f"cannot evaluate {spec.title!r} unrolled: it combines the checkpoints of one run, "
                             f"ensemble= one of {sorted(CHECKPOINTS_AFTER)}")
    _check_ground_truth(task, ground_truth)
    gradients = _Gradients(task, batch_size, progress)
    members = _Members(task, batch_size, progress)
    rows = []
    for spec in specs:
        chosen = projection if isinstance(spec.projection, str) and spec.projection == INHERIT else spec.projection
        members_seconds = 0.0
        if spec.ensemble is None:
            train, queries, collect_seconds = gradients.get(chosen)
            began = time.perf_counter()
            matrix = _score(spec, task, train, queries, chosen, batch_size, seed)
        else:
            models, trains, queries, collect_seconds, members_seconds = members.get(spec.ensemble, spec.members, chosen)
            began, train = time.perf_counter(), trains[0]
            score = _score_unrolled if spec.unrolled is not None else _score_ensemble
            matrix = score(spec, task, models, trains, queries, chosen, batch_size)
        seconds = time.perf_counter() - began
        result = lds(matrix, ground_truth.masks, ground_truth.outcomes)
        rows.append(Row(spec.title, result.mean, result.se, seconds, collect_seconds, result, dict(spec.options),
                        train.vectors.shape[1], members_seconds))
    return rows


def _score(spec: MethodSpec, task: Task, train: Any, queries: Any, projection: LoGra | None, batch_size: int,
           seed: int) -> Tensor:
    if spec.name == RANDOM:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(len(queries.ids), len(train.ids), generator=generator)
    attributor = Attributor(spec.name, train, **spec.options)
    fit = attributor.method.fit if attributor.method.has_fit() else None
    needs_fit = spec.fit if spec.fit is not None else callable(fit)
    if needs_fit:
        if not callable(fit):
            raise ValueError(f"method {spec.name!r} has no fit()")
        attributor.fit(task.model, task.train_batches(batch_size), task.loss_fn,
                       **_fit_kwargs(fit, projection, spec.fit_options))
    return attributor.score(queries, topk=None, matrix=True).matrix


def _check_ground_truth(task: Task, ground_truth: GroundTruth) -> None:
    if ground_truth.masks.shape[1] != task.num_train:
        raise ValueError(f"the ground truth covers {ground_truth.masks.shape[1]} training examples, "
                         f"the task has {task.num_train}")
    if ground_truth.outcomes.shape[1] != task.num_queries:
        raise ValueError(f"the ground truth has {ground_truth.outcomes.shape[1]} queries, the task {task.num_queries}")
    built_for = ground_truth.meta.get("settings", {}).get("config")
    if built_for is not None and built_for != task.config:
        raise ValueError("the ground truth was built for another task configuration "
                         f"({built_for.get('task')} {built_for.get('settings')}, data {built_for.get('data')})")


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table: method, LDS ± SE, seconds (fit + score)."""
    lines = ["| method | LDS ± SE | fit + score (s) |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row.method}` | {row.lds_mean:.3f} ± {row.lds_se:.3f} | {row.seconds:.2f} |")
    return "\n".join(lines)
