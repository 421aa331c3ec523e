"""Ensembles: one attribution method over C checkpoints of one training run, or C independently trained models.

``Ensemble(method, train=[store_1, ..., store_C])`` holds
one :class:`~gradtrace.Attributor` per member: training gradients collected at that member's weights, the
method's state (curvature, kernel) fitted there (:meth:`Ensemble.fit` with ``models=`` or ``checkpoints=``),
and queries scored with query gradients taken at the same weights (:meth:`Ensemble.score` with one query set
per member). The combined score of query ``q`` and training example ``i`` is

    tau(q, i) = sum_c w_c * S_c[q, i] / m_c,    m_c = mean over all (q, i) of |S_c[q, i]|,

with ``w_c`` the weights (default equal), normalised to sum to 1. **Why normalise:** each member's scores are in
its own units -- a gradient product at a checkpoint early in training is orders of magnitude larger than at the
converged model, an inverse curvature rescales them again, and two independently trained models differ in
scale too -- so an unnormalised sum is decided by whichever member has the largest scores. Dividing each
member's matrix by its mean absolute value puts every member on the same scale (a positive factor per member:
each member's own ranking is unchanged, and the sign convention -- positive = helpful -- is kept); the weights
then say how much each member counts. ``normalize=False`` sums ``w_c * S_c`` as they are.

Scoring streams the training gradients twice: one pass for the normalisers ``m_c`` (every member's block of
scores, reduced to a sum of absolute values), then the engine's own multi-checkpoint pass, which combines the
members block by block with weights ``w_c / m_c`` into the streaming top-k (exact: the top-k of the combined
scores) and the ``[Q, N]`` matrix when it fits -- memory bounded as for one model, no per-member matrix. Cost:
C x collection (one store per member), C x fit, 2 C x the scoring products of one model.

Members are matched by example id: their stores may hold the same ids in another order (a different id set is
an error naming the missing ids). Their gradients must be comparable: the same captured parameters and the same
projection (a clear error otherwise: collect every member with the same ``CaptureOptions`` ``layers`` and
``projection``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..capture.gradient_set import GradientSet, as_source
from ..common.checkpoints import checkpoint_path, load_into, read_state_dict, restored_weights
from ..fit.methods import Method, get_method
from ..store.spec import GradientSpec
from .engine import Attributor, _block_buffer, _block_product, _check_block, _check_prepared, is_member_list
from .scores import Scores

__all__ = ["Ensemble", "EnsembleError"]


class EnsembleError(ValueError):
    """An ensemble's members do not fit together (ids, parameters, projection, counts, weights)."""


class _Aligned:
    """Rows of ``source`` in the order of ``ids`` (a gradient source, read through ``source.rows`` for a store)."""

    # the source protocol around read(), as a gradient set has it
    __len__, dim, iter_blocks = GradientSet.__len__, GradientSet.dim, GradientSet.iter_blocks

    def __init__(self, source: Any, ids: list[str], order: Tensor) -> None:
        self.source, self.ids, self.order, self.spec = source, ids, order, source.spec
        self._all: Tensor | None = None

    def read(self, start: int, stop: int, device: torch.device | str | None = None) -> Tensor:
        rows = self.order[start:stop]
        if hasattr(self.source, "rows"):  # a gradient store: one gather per shard
            return self.source.rows(rows.tolist(), device)
        if self._all is None:  # in memory: a view of its vectors
            self._all = self.source.read(0, len(self.source))
        out = self._all[rows.to(self._all.device)]
        return out.to(device) if device is not None else out


def align(sources: Sequence[Any], what: str) -> list[Any]:
    """``sources`` with rows in the first one's id order (a view where the order differs); a different id set is
    an :class:`EnsembleError` naming ids missing on either side."""
    ids = list(sources[0].ids)
    index = {ident: row for row, ident in enumerate(ids)}
    out = [sources[0]]
    for c, source in enumerate(sources[1:], start=1):
        theirs = list(source.ids)
        if theirs == ids:
            out.append(source)
            continue
        mine = {ident: row for row, ident in enumerate(theirs)}
        missing = [i for i in ids if i not in mine]
        extra = [i for i in theirs if i not in index]
        if missing or extra or len(theirs) != len(ids):
            raise EnsembleError(f"{what} {c} holds other examples than {what} 0: {len(missing)} missing (e.g. "
                                f"{missing[:3]}), {len(extra)} not in {what} 0 (e.g. {extra[:3]}); collect every "
                                "member over the same examples (the same ids)")
        order = torch.tensor([mine[i] for i in ids], dtype=torch.long)
        out.append(_Aligned(source, ids, order))
    return out


def _member_methods(method: str | Method | Sequence[Method], count: int, options: dict[str, Any]) -> list[Method]:
    """One method instance per member: built from a name, copied from an instance, or given as a list."""
    if isinstance(method, (list, tuple)):
        if len(method) != count:
            raise EnsembleError(f"{len(method)} methods for {count} members: pass one method per member (or one "
                                "method for all)")
        if options:
            raise EnsembleError("method options go with a method name, not with a list of method instances")
        methods = [get_method(m) for m in method]
    elif isinstance(method, Method):
        if options:
            raise EnsembleError("method options go with a method name, not with a method instance")
        methods = [copy.deepcopy(method) for _ in range(count)]
    else:
        methods = [get_method(method, **options) for _ in range(count)]
    names = {m.name for m in methods}
    if len(names) > 1:
        raise EnsembleError(f"an ensemble runs one method on every member, got {sorted(names)}")
    if methods[0].multi_checkpoint:
        raise EnsembleError(f"{methods[0].name} already combines several checkpoints: pass its list of stores "
                            f"to Attributor('{methods[0].name}', [...]) directly, not as an ensemble")
    return methods


def check_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """``weights`` (default: equal) as floats summing to 1; refuses a wrong length, negative or non-finite
    values, and all zeros."""
    if weights is None:
        return [1.0 / count] * count
    values = [float(w) for w in weights]
    if len(values) != count:
        raise EnsembleError(f"{len(values)} weights for {count} members: pass one weight per member")
    bad = [(c, w) for c, w in enumerate(values) if not math.isfinite(w) or w < 0]
    if bad:
        raise EnsembleError(f"weights must be finite and >= 0, got {bad[0][1]} for member {bad[0][0]}")
    total = sum(values)
    if total <= 0:
        raise EnsembleError("the weights are all zero: give at least one member a positive weight")
    return [w / total for w in values]


class _Combined(Method):
    """The members' methods as one multi-checkpoint method for the engine: member ``c``'s transforms, its scores
    weighted by ``w_c / m_c``. Its query side is prepared once per :meth:`Ensemble.score` (``prepared``)."""

    multi_checkpoint = True

    def __init__(self, members: list[Method], specs: list[GradientSpec]) -> None:
        self.members, self.specs = members, specs
        self.name = members[0].name
        self.needs = members[0].needs
        self.description = f"ensemble of {len(members)} x {members[0].name}"
        self.factors: list[float] = [1.0] * len(members)
        self.prepared: list[Tensor] | None = None

    def check_ready(self) -> None:
        for member in self.members:
            member.check_ready()

    def bind(self, spec: GradientSpec) -> None:
        """Bind every member to its own gradients' spec (``spec``, member 0's, is the engine's); once per
        :meth:`Ensemble.score`, which binds before it prepares the queries."""
        if self.prepared is not None:
            return
        for member, own in zip(self.members, self.specs):
            if hasattr(member, "bind"):
                member.bind(own)

    def checkpoint_weights(self, count: int) -> list[float]:
        return list(self.factors)

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        if self.prepared is not None:
            return self.prepared[checkpoint]
        return self.members[checkpoint].prepare_queries(queries, 0)

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        return self.members[checkpoint].prepare_train(block, 0)

    def options(self) -> dict[str, Any]:
        return self.members[0].options()


class Ensemble:
    """One attribution method over several checkpoints or independently trained models (see the module docstring).

    Args:
        method: a registered method name (with ``**method_options``), a method instance (copied per member) or a
            list of one instance per member (e.g. each with its saved curvature).
        train: one training-gradient source per member (store, path, :class:`GradientSet`, list of batches),
            over the same examples.
        weights: one non-negative weight per member (default: equal), normalised to sum to 1.
        normalize: divide each member's scores by their mean absolute value before weighting (default True).
        block_rows, device, matrix_bytes: as for :class:`~gradtrace.Attributor`.
    """

    def __init__(self, method: str | Method | Sequence[Method] = "grad_dot", train: Any = None, *,
                 weights: Sequence[float] | None = None, normalize: bool = True, block_rows: int | None = None,
                 device: torch.device | str | None = None, matrix_bytes: int = 2**30, **method_options: Any) -> None:
        if not is_member_list(train):
            raise EnsembleError("an ensemble needs a list of training gradients, one per checkpoint or model: "
                                "train=[store_1, ..., store_C]")
        sources = [as_source(s) for s in train]
        for c, source in enumerate(sources[1:], start=1):
            sources[0].spec.check_compatible(source.spec, f"member {c}'s training gradients vs member 0's (collect "
                                             "every member with the same CaptureOptions layers and projection)")
        aligned = align(sources, "member")
        methods = _member_methods(method, len(sources), method_options)
        settings = {"block_rows": block_rows, "device": device, "matrix_bytes": matrix_bytes}
        self.members = [Attributor(m, s, **settings) for m, s in zip(methods, sources)]
        self.weights = check_weights(weights, len(sources))
        self.normalize = bool(normalize)
        self.combined = _Combined(methods, [s.spec for s in sources])
        self.engine = Attributor(self.combined, aligned, **settings)
        self.profile: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.members)

    @property
    def method(self) -> Method:
        """Member 0's method (all members run the same one)."""
        return self.members[0].method

    @property
    def spec(self) -> GradientSpec:
        return self.engine.spec

    @property
    def train_ids(self) -> list[str]:
        return self.engine.train_ids

    def fit(self, model: nn.Module | None = None, data: Any = None, loss_fn: Any = None, *,
            models: Sequence[nn.Module] | None = None, checkpoints: Sequence[Any] | None = None,
            member_options: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> Ensemble:
        """Fit every member's method at that member's weights (a no-op for methods that need nothing).

        Args:
            model: with ``checkpoints``, the model each checkpoint is loaded into (its weights are restored
                afterwards); alone, refused for more than one member (its weights are one member's).
            data, loss_fn: the training data and per-example loss, shared by all members.
            models: one model per member (independently trained models, or checkpoints already loaded).
            checkpoints: one checkpoint per member: a state dict, a weights file (``.safetensors``, or a
                ``torch.save``-d state dict, loaded with ``weights_only=True``), a checkpoint directory
                (``save_pretrained`` / Trainer ``checkpoint-N``) or an entry of
                :func:`gradtrace.integrations.checkpoints`.
            member_options: one dict of fit options per member, for options that differ between members (e.g.
                trackstar's ``optimizer=``: the Adam state at that member's weights); merged with ``options``
                (an option given in both is refused). A method's :attr:`~gradtrace.fit.Method.per_member_options`
                not given per member are taken from each checkpoint directory (a Trainer ``checkpoint-N`` holds
                its ``optimizer.pt``); one value shared by several members is refused.
            **options: passed to every member's fit.
        """
        if models is not None and checkpoints is not None:
            raise EnsembleError("pass models=[...] or checkpoints=[...], not both")
        if data is not None and iter(data) is data:
            data = list(data)  # every member reads it
        count = len(self.members)
        each = self._member_options(options, member_options, checkpoints)
        if checkpoints is not None:
            self._fit_checkpoints(model, checkpoints, data, loss_fn, options, each)
        elif models is not None:
            if model is not None:
                raise EnsembleError("pass models=[...] (one per member) or model= with checkpoints=[...], not both")
            if len(models) != count:
                raise EnsembleError(f"{len(models)} models for {count} members: pass one model per member, at the "
                                    "weights its gradients were collected at")
            for member, member_model, own in zip(self.members, models, each):
                member.fit(member_model, data, loss_fn, **options, **own)
        elif model is not None and count > 1:
            raise EnsembleError(f"one model for {count} members: fit each member at its own weights with "
                                "models=[...] or checkpoints=[...]")
        else:
            for member, own in zip(self.members, each):
                member.fit(model, data, loss_fn, **options, **own)
        return self

    def _member_options(self, shared: dict[str, Any], given: Sequence[Mapping[str, Any]] | None,
                        checkpoints: Sequence[Any] | None) -> list[dict[str, Any]]:
        """Each member's own fit options: ``given`` (checked), completed by the method's per-member options read
        from checkpoint directories; a per-member option shared by several members is refused."""
        count, method = len(self.members), self.method
        if given is None:
            each: list[dict[str, Any]] = [{} for _ in range(count)]
        elif isinstance(given, Mapping) or not all(isinstance(o, Mapping) for o in given):
            raise EnsembleError("member_options is a list of dicts, one per member: member_options=[{...}, ...]")
        elif len(given) != count:
            raise EnsembleError(f"{len(given)} member_options for {count} members: pass one dict per member")
        else:
            each = [dict(o) for o in given]
        both = sorted({k for o in each for k in o} & shared.keys())
        if both:
            raise EnsembleError(f"{both[0]}= is given for every member and in member_options: give it once")
        for name in method.per_member_options:
            if name in shared and count > 1:
                raise EnsembleError(
                    f"{method.name}: {name}= holds the state of one model's weights, so one value cannot serve "
                    f"{count} members: give each member its own, member_options=[{{'{name}': ...}}, ...] in the "
                    "members' order, or pass checkpoints=[...] as checkpoint directories holding it")
            if name in shared or checkpoints is None:
                continue
            for own, checkpoint in zip(each, checkpoints):
                path = checkpoint_path(checkpoint)
                if name not in own and path is not None and path.is_dir():
                    own[name] = path  # a Trainer checkpoint-N directory holds the state of its weights
        return each

    def _fit_checkpoints(self, model: nn.Module | None, checkpoints: Sequence[Any], data: Any, loss_fn: Any,
                         options: dict[str, Any], each: list[dict[str, Any]]) -> None:
        """Load each checkpoint into ``model``, fit its member there, and restore the model's weights."""
        if model is None:
            raise EnsembleError("checkpoints=[...] are loaded into a model: pass fit(model, data, loss_fn, "
                                "checkpoints=[...])")
        if len(checkpoints) != len(self.members):
            raise EnsembleError(f"{len(checkpoints)} checkpoints for {len(self.members)} members: pass one "
                                "checkpoint per member, in the order of the training gradients")
        with restored_weights(model):
            for c, (member, checkpoint, own) in enumerate(zip(self.members, checkpoints, each)):
                load_into(model, read_state_dict(checkpoint), f"checkpoint {c}")
                member.fit(model, data, loss_fn, **options, **own)

    def score(self, queries: Sequence[Any], *, topk: int | None = 100, matrix: bool | str = "auto",
              progress: bool = False) -> Scores:
        """Score the queries against every training example with the combined scores (module docstring).

        Args:
            queries: one query-gradient set per member, taken at that member's weights (same query ids).
            topk, matrix, progress: as for :meth:`Attributor.score`.
        """
        count = len(self.members)
        if not is_member_list(queries) or len(queries) != count:
            given = len(queries) if is_member_list(queries) else 1
            raise EnsembleError(f"{given} query set(s) for {count} members: pass a list of {count} query gradient "
                                "sets, each collected at its member's weights")
        query_sets = align([as_source(q) for q in queries], "query set")
        started = time.perf_counter()
        self.combined.check_ready()
        self.combined.bind(self.spec)
        prepared = []
        for c, (q, member) in enumerate(zip(query_sets, self.members)):
            member.spec.check_compatible(q.spec, f"queries vs training gradients (member {c})")
            prepared.append(member.method.prepare_queries(q.read(0, len(q), member.device).to(torch.float32), 0))
            _check_prepared(prepared[-1], q.ids, member.method.name, c)
        prepared_s = time.perf_counter() - started
        scales = self._scales(prepared, query_sets[0].ids) if self.normalize else [1.0] * count
        normalize_s = time.perf_counter() - started - prepared_s
        self.combined.factors = [w / s for w, s in zip(self.weights, scales)]
        self.combined.prepared = prepared
        try:
            scores = self.engine.score(query_sets, topk=topk, matrix=matrix, progress=progress)
        finally:
            self.combined.prepared = None
        self.profile = {**scores.meta["profile"], "prepare_queries_s": prepared_s, "normalize_s": normalize_s}
        scores.meta["profile"] = dict(self.profile)
        scores.meta["ensemble"] = {"members": count, "weights": list(self.weights), "normalize": self.normalize,
                                   "mean_abs": list(scales) if self.normalize else None,
                                   "member_options": [m.method.options() for m in self.members]}
        return scores

    def self_scores(self, normalize: str = "none") -> Tensor:
        """``[N]`` self-influence of every training example, combined over the members as scores are:
        ``sum_c w_c s_c[i] / m_c`` with ``s_c`` member ``c``'s own :meth:`Attributor.self_scores` and ``m_c`` their
        mean absolute value (``normalize=False`` at construction: unnormalised), in member 0's id order.
        ``normalize``: as :meth:`Attributor.self_scores` (``"length"``: per target token)."""
        total = torch.zeros(len(self.train_ids), dtype=torch.float64)
        for c, (member, weight) in enumerate(zip(self.members, self.weights)):
            own = member.self_scores(normalize=normalize).to(torch.float64)
            aligned = self.engine.train[c]
            if isinstance(aligned, _Aligned):  # this member's store holds the ids in another order
                own = own[aligned.order]
            scale = float(own.abs().mean()) if self.normalize else 1.0
            if scale == 0:
                raise EnsembleError(f"member {c}'s self-influence is zero for every example, so it cannot be "
                                    "normalised; check its gradients (or pass normalize=False)")
            total += weight / scale * own
        return total.to(torch.float32)

    def _scales(self, prepared: list[Tensor], query_ids: Sequence[str]) -> list[float]:
        """``m_c``: the mean absolute score of every member, from one streamed pass (float64 sums)."""
        engine, name = self.engine, self.method.name
        num_train, num_q = len(engine.train[0]), prepared[0].shape[0]
        if num_train == 0:
            raise ValueError("the training gradients are empty")
        totals = torch.zeros(len(prepared), dtype=torch.float64)
        buffer = _block_buffer(engine.train, engine.block_rows, engine.device)
        for offset in range(0, num_train, engine.block_rows):
            stop = min(num_train, offset + engine.block_rows)
            for c, source in enumerate(engine.train):
                part = _block_product(prepared[c], source, offset, stop, self.combined, c, buffer)
                _check_block(part, query_ids, engine.train_ids, offset, f"{name} (member {c})")
                totals[c] += part.abs().sum(dtype=torch.float64).cpu()
        means = (totals / (num_q * num_train)).tolist()
        zero = [c for c, m in enumerate(means) if m == 0]
        if zero:
            raise EnsembleError(f"member {zero[0]}'s scores are all zero, so they cannot be normalised; check its "
                                "gradients (or pass normalize=False)")
        return means

    def __repr__(self) -> str:
        return f"Ensemble({self.method.name!r}, members={len(self)}, weights={self.weights})"


