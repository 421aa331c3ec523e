"""LESS (Xia et al. 2024): Adam-preconditioned gradient features, cosine scores summed over checkpoints.

For a checkpoint ``c`` with Adam moments ``m_c, v_c`` after ``t_c`` steps, a training example's feature is the
update Adam would make if its gradient ``g`` were the next one (bias-corrected with step ``t_c + 1``)::

    m' = b1 m_c + (1 - b1) g        v' = b2 v_c + (1 - b2) g**2
    Gamma(z) = (m' / (1 - b1**(t+1))) / (sqrt(v' / (1 - b2**(t+1))) + eps)

computed from the *exact* per-example gradient ``g`` of the captured parameters (the map is element-wise and
nonlinear, so it cannot be applied to LoGra-projected gradients), then projected with a dense or sparse random
sketch to ``k`` dims. Query (validation) features are the plain per-example gradients, projected with the same
sketch. The score is ``sum_c eta_c cos(Gamma_c(z), g_c(q))`` with ``eta_c`` the mean learning rate of the epoch
that checkpoint ``c`` closes. Positive = the training example helps the query.

* :func:`less_features` / :func:`less_query_features` produce the two sides (in memory or into a store);
* the ``less`` method scores them (``Attributor("less", [train_1, ...], weights=[...])``);
* :func:`less_aggregate` reduces a score matrix to LESS's selection score (mean over each target task's
  queries, max over tasks).

Both sides carry a projection spec of kind ``"less"`` (the sketch and the parameters it flattens), so they can
never be scored against, or stored with, plain or LoGra gradients. Their ``convention`` records which side they
are (``features``: ``"adam"`` or ``"sgd"``) and, for the training side, the optimizer's hyperparameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...capture import capture
from ...capture.driver import run_capture
from ...capture.gradient_set import GradientSet
from ...capture.sink.rows import MemoryRows, RowSink, RowTransform, ShardRows
from ...common.checks import rates
from ...common.modules import strip_wrappers, unwrap
from ...grad.batch import GradientBatch
from ...loss.functions import LossFn, causal_lm_loss, default_loss
from ...options import CaptureOptions, Loss, RunOptions, StoreOptions, with_record
from ...options.base import option_object
from ...projection.sketch import Sketch
from ...store import GradientSpec, GradientStore, ShardWriter, SpecMismatch, model_fingerprint
from ...store.writer import resolved_store_options
from .base import Method, MissingStage, register_method
from .similarity import _normalize

__all__ = ["AdamState", "Less", "NoAdamState", "adam_states", "less_aggregate", "less_features", "less_query_features"]

SCHEME = "gradtrace/less/v1"
SKETCH_KEY = "less"  # the key the sketch matrix is generated under (``sketch.matrix(dim, SKETCH_KEY)``)


class NoAdamState(ValueError):
    """A captured parameter's optimizer state is not Adam's (another optimizer's, or none: never stepped)."""

    def __init__(self, message: str, sgd: bool = False) -> None:
        super().__init__(message)
        self.sgd = sgd  # the state is SGD's (``momentum_buffer``, or an SGD group without momentum)


@dataclass
class AdamState:
    """Adam's state for one parameter (tensors shaped like the parameter) and its group's hyperparameters."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: float
    beta1: float
    beta2: float
    eps: float
    max_exp_avg_sq: Tensor | None = None  # amsgrad
    maximize: bool = False
    weight_decay: float = 0.0
    decoupled: bool = False

    def hyperparameters(self) -> dict[str, Any]:
        return {"betas": [self.beta1, self.beta2], "eps": self.eps, "step": self.step,
                "amsgrad": self.max_exp_avg_sq is not None, "maximize": self.maximize,
                "weight_decay": self.weight_decay, "decoupled_weight_decay": self.decoupled}

    @torch.no_grad()
    def direction(self, grads: Tensor) -> Tensor:
        """``[E, n]`` per-example gradients -> ``[E, n]`` Adam update directions (float32, bias-corrected)."""
        grads = grads.to(torch.float32)
        if self.maximize:
            grads = -grads
        device = grads.device
        m = self.exp_avg.reshape(1, -1).to(device, torch.float32)
        v = self.exp_avg_sq.reshape(1, -1).to(device, torch.float32)
        m_new = grads.mul(1 - self.beta1).add_(m, alpha=self.beta1)
        v_new = grads.square().mul_(1 - self.beta2).add_(v, alpha=self.beta2)
        if self.max_exp_avg_sq is not None:
            v_new = torch.maximum(v_new, self.max_exp_avg_sq.reshape(1, -1).to(device, torch.float32))
        t = self.step + 1
        m_hat = m_new.div_(1 - self.beta1 ** t)
        v_hat = v_new.div_(1 - self.beta2 ** t)
        return m_hat.div_(v_hat.sqrt_().add_(self.eps))


def _named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {strip_wrappers(n): p for n, p in unwrap(model).named_parameters()}


def _state_dict_params(model: nn.Module, state_dict: dict[str, Any],
                       param_names: Sequence[str] | None) -> tuple[dict[int, str], str]:
    """Map the integer parameter indices of an optimizer ``state_dict`` to parameter names."""
    groups = state_dict["param_groups"]
    indices = [i for g in groups for i in g["params"]]
    if param_names is not None:
        if len(param_names) != len(indices):
            raise ValueError(f"param_names lists {len(param_names)} names, the optimizer state has {len(indices)} "
                             "parameters")
        return {i: strip_wrappers(n) for i, n in zip(indices, param_names)}, "param_names"
    if all("param_names" in g for g in groups):  # optimizers built from model.named_parameters()
        return {i: strip_wrappers(n) for g in groups for i, n in zip(g["params"], g["param_names"])}, "names"
    if len(groups) > 1:  # grouped (e.g. the Trainer's weight-decay groups): its order is not the model's
        raise ValueError(f"the optimizer state has {len(groups)} parameter groups and records no parameter names, so "
                         "its order need not be the model's: name them, with param_names= where the call takes it or "
                         "as each param group's 'param_names' (in its order; a GradtraceCallback store records them "
                         "as config['trainer']['optimizer_parameters']) or the optimizer itself, or save them beside "
                         "the checkpoint's optimizer.pt as gradtrace-optimizer.json "
                         "({\"optimizer_parameters\": [...]}, which GradtraceCallback writes)")
    named = list(_named_params(model).items())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    for order, what in ((named, "all parameters"), (trainable, "trainable parameters")):
        if len(order) == len(indices):
            return {i: order[pos][0] for pos, i in enumerate(indices)}, what
    raise ValueError(f"cannot map the optimizer state's {len(indices)} parameters to the model's ({len(named)} "
                     f"parameters, {len(trainable)} trainable): pass the optimizer itself, or list its parameters' "
                     "names in each param group's 'param_names', in the order they were given to it")


def adam_states(model: nn.Module, optimizer_state: torch.optim.Optimizer | dict[str, Any], names: Iterable[str], *,
                param_names: Sequence[str] | None = None) -> dict[str, AdamState]:
    """The Adam state of each parameter in ``names`` (canonical ``model.named_parameters()`` names).

    ``optimizer_state`` is a ``torch.optim.Adam/AdamW`` instance or its ``state_dict()``. A state dict's
    parameters are matched to the model's by the names it records (optimizers built from
    ``model.named_parameters()``), else by ``param_names``, else by position in ``model.named_parameters()``
    order (all parameters, or the trainable ones, whichever count matches; shapes are checked). Raises when a
    parameter has no Adam state.
    """
    names = list(names)
    params = _named_params(model)
    entries: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    how = "optimizer"
    if isinstance(optimizer_state, torch.optim.Optimizer):
        group_of = {id(p): g for g in optimizer_state.param_groups for p in g["params"]}
        for name in names:
            param = params.get(name)
            if param is None:
                raise KeyError(f"parameter {name!r} is not in the model")
            if id(param) in group_of:
                entries[name] = (optimizer_state.state.get(param, {}), group_of[id(param)])
    elif isinstance(optimizer_state, dict) and "state" in optimizer_state and "param_groups" in optimizer_state:
        index_names, how = _state_dict_params(model, optimizer_state, param_names)
        by_name = {index_names[i]: (optimizer_state["state"].get(i, {}), g)
                   for g in optimizer_state["param_groups"] for i in g["params"]}
        entries = {n: by_name[n] for n in names if n in by_name}
    else:
        raise TypeError("optimizer_state must be a torch.optim.Adam/AdamW optimizer or its state_dict(), got "
                        f"{type(optimizer_state).__name__}")
    out = {}
    for name in names:
        if name not in entries:
            raise ValueError(f"parameter {name!r} is captured but not optimized by this optimizer; capture only the "
                             "optimized parameters (CaptureOptions(layers=...))")
        state, group = entries[name]
        missing = [k for k in ("exp_avg", "exp_avg_sq", "step") if k not in state]
        if missing:
            sgd = "momentum_buffer" in state or ("nesterov" in group and "betas" not in group)
            hint = ("SGD's state, not an Adam state: SGD keeps no second moment" if sgd else
                    "the optimizer has not stepped on it yet" if not state else
                    f"its state has {sorted(state)}: not an Adam state")
            raise NoAdamState(f"parameter {name!r} has no Adam state ({', '.join(missing)} missing: {hint})", sgd=sgd)
        if tuple(state["exp_avg"].shape) != tuple(params[name].shape):
            raise ValueError(f"the optimizer state matched to {name!r} (by {how}) has shape "
                             f"{tuple(state['exp_avg'].shape)}, the parameter {tuple(params[name].shape)}: pass the "
                             "optimizer itself or name its parameters (param groups' 'param_names')")
        betas = group.get("betas", (0.9, 0.999))
        amsgrad = bool(group.get("amsgrad", False))
        out[name] = AdamState(
            exp_avg=state["exp_avg"].detach(), exp_avg_sq=state["exp_avg_sq"].detach(), step=float(state["step"]),
            beta1=float(betas[0]), beta2=float(betas[1]), eps=float(group.get("eps", 1e-8)),
            max_exp_avg_sq=state["max_exp_avg_sq"].detach() if amsgrad else None,
            maximize=bool(group.get("maximize", False)), weight_decay=float(group.get("weight_decay", 0.0)),
            decoupled=bool(group.get("decoupled_weight_decay", False)))
    return out


# ------------------------------------------------------------------------------------------------------ features
def _projection_spec(sketch: Sketch, inputs: list[tuple[str, int]]) -> dict[str, Any]:
    return {"kind": "less", "scheme": SCHEME, "sketch": sketch.to_dict(), "inputs": [[n, d] for n, d in inputs]}


def _optimizer_record(states: dict[str, AdamState]) -> dict[str, Any]:
    records = {name: s.hyperparameters() for name, s in states.items()}
    first = next(iter(records.values()))
    if all(r == first for r in records.values()):
        return first
    return {"per_param": records}


def _default_loss(example_loss: str) -> LossFn:
    def loss(model: nn.Module, batch: Any) -> Tensor:
        fn = default_loss(batch)
        if fn is causal_lm_loss:
            fn = functools.partial(causal_lm_loss, mean=example_loss == "mean")
        return fn(model, batch)

    return loss


class _LessRows(RowTransform):
    """Rows of LESS features: exact per-example gradients -> (Adam update directions) -> sketched to ``k`` dims."""

    def __init__(self, sketch: Sketch, convention: dict[str, Any], states: dict[str, AdamState] | None) -> None:
        self.sketch, self.convention = sketch, convention
        self.states = states  # None: plain gradients

    def spec(self, layout: GradientSpec) -> GradientSpec:
        if layout.projection is not None:
            raise ValueError("LESS features need exact per-example gradients (capture without projection)")
        return replace(layout, params=[("less", self.sketch.k)],
                       projection=_projection_spec(self.sketch, layout.params), convention=self.convention)

    def vectors(self, batch: GradientBatch) -> Tensor:
        parts = []
        for name, grad in batch.params.items():
            flat = grad.flat()  # [E, numel] exact gradient of each example's own loss
            parts.append(self.states[name].direction(flat) if self.states is not None else flat)
        return self.sketch.project(torch.cat(parts, dim=1), SKETCH_KEY)  # [E, k] float32

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        return {}


def _check_store_side(path: Path, spec: GradientSpec, overwrite: bool) -> None:
    """Refuse to add features of another side, optimizer state or sketch to an existing LESS store."""
    if overwrite or not (path / "manifest.json").exists():
        return
    existing = GradientStore.open(path, verify=False, allow_incomplete=True).spec
    existing.check_compatible(spec, f"store {path}")
    for key in ("features", "optimizer"):
        if existing.convention.get(key) != spec.convention.get(key):
            raise SpecMismatch(f"store {path} holds LESS features with {key}={existing.convention.get(key)!r}, this "
                               f"run makes {key}={spec.convention.get(key)!r}; write them to another store")


def _run(model: nn.Module, data: Iterable[Any], loss: Loss | LossFn | None, states: Any, features: str,
         store: str | Path | None, options: CaptureOptions | None, store_options: StoreOptions | None,
         run: RunOptions | None) -> GradientSet | GradientStore:
    """Capture ``data``'s exact gradients as ``options`` say and turn them into LESS features (Adam directions
    when ``states`` resolves an optimizer state), sketched with ``options.projection``, kept in memory or written
    to ``store`` as ``store_options`` say (the store records the option objects)."""
    options = option_object(options, CaptureOptions, "options")
    projection = options.projection
    if not isinstance(projection, Sketch):
        got = "None" if projection is None else type(projection).__name__
        raise TypeError("LESS features are sketched as a whole: give CaptureOptions(projection=DenseProjection(k) or "
                        f"SparseProjection(k)) (gradtrace.projection), the same for both sides; got projection={got}"
                        + (" (LoGra projects each layer, but LESS's Adam map needs exact gradients)"
                           if projection is not None else ""))
    store_options = option_object(store_options, StoreOptions, "store_options")
    shard_rows = store_options.shard_rows or (4096 if store_options.shard_bytes is None else None)
    store_options = replace(resolved_store_options(store, store_options), shard_rows=shard_rows)
    run = option_object(run, RunOptions, "run")
    loss = Loss.of(loss)
    if loss.reduction is not None or loss.scale is not None:
        raise ValueError("the LESS features sum each example's own loss themselves: leave Loss.reduction and "
                         "Loss.scale unset")
    if store is None and (store_options.resume or store_options.overwrite):
        raise ValueError("resume/overwrite apply to a store: pass store=...")
    path = Path(store) if store is not None else None
    skip: set[str] = set()
    if path is not None and store_options.resume and (path / "manifest.json").exists():
        skip = set(GradientStore.open(path, verify=False, allow_incomplete=True).ids)
    writing = replace(store_options, config=with_record(store_options.config, capture=options, store=store_options,
                                                        loss=loss))
    # each gradient is that of the example's own loss (the loss function reduces its tokens: example_loss)
    cap = capture(model, replace(loss, fn=None, likelihood=None, reduction="sum", example_loss="sum"),
                  options=replace(options, projection=None), callbacks=[], keep_batches=False)
    example_loss = loss.example_loss
    convention: dict[str, Any] = {"reduction": "sum", "example_loss": example_loss, "features": features}
    if states is not None:  # resolve the optimizer state before computing anything
        states = states(cap.selection.param_order)
        convention["optimizer"] = _optimizer_record(states)

    def open_store(spec: GradientSpec) -> ShardWriter:
        assert path is not None
        _check_store_side(path, spec, writing.overwrite)
        return ShardWriter(path, spec, writing)

    rows: ShardRows | MemoryRows = ShardRows(open_store) if path is not None else MemoryRows()
    sink = RowSink(rows, transform=_LessRows(projection, convention, states), dtype=store_options.dtype,
                   fingerprint=lambda: model_fingerprint(model), what="the first one")
    cap.callbacks.append(sink)
    run_capture(model, data, loss.fn or _default_loss(example_loss), cap, run, skip=skip, what=f"less ({features})")
    if isinstance(rows, ShardRows):
        if rows.writer is None:
            if not skip:
                raise ValueError("the data produced no examples")
            # resumed with nothing left to compute: mark this rank's part of the store complete
            ShardWriter(path, GradientStore.open(path, verify=False, allow_incomplete=True).spec,
                        StoreOptions(resume=True)).close()
        return GradientStore.open(path)
    if not rows.ids:
        raise ValueError("the data produced no examples")
    out = GradientSet(rows.vectors(), rows.ids, rows.spec, fields=rows.kept_fields())
    out.dropped = list(rows.ledger.skipped["nonfinite"])
    return out


def less_features(model: nn.Module, optimizer_state: torch.optim.Optimizer | dict[str, Any], data: Iterable[Any],
                  loss: Loss | LossFn | None = None, *, options: CaptureOptions, store: str | Path | None = None,
                  store_options: StoreOptions | None = None, run: RunOptions | None = None
                  ) -> GradientSet | GradientStore:
    """LESS training features at one checkpoint: projected Adam updates of each example's exact gradient.

    Args:
        model: the model at the checkpoint (not modified; run in eval mode).
        optimizer_state: the ``torch.optim.Adam``/``AdamW`` optimizer at that checkpoint, or its ``state_dict()``
            (see :func:`adam_states` for how its entries are matched to parameters; a state dict that does not
            record its parameters' names takes them as each param group's ``"param_names"``, as torch records
            them for an optimizer made from ``model.named_parameters()``).
        data: batches, as for :func:`gradtrace.collect`.
        loss: the per-example loss (:class:`gradtrace.Loss` or its ``fn``); default: the causal-LM loss (the mean
            over target tokens, ``Loss(example_loss="mean")``, as LESS does) or cross-entropy. ``example_loss`` is
            recorded in the spec; queries must use the same.
        options: what is captured and how it is sketched (:class:`gradtrace.CaptureOptions`): ``projection`` a
            :class:`~gradtrace.projection.DenseProjection` or :class:`~gradtrace.projection.SparseProjection` to
            ``k`` dims, applied to the concatenated features of all captured parameters (matrix key ``"less"``;
            queries must use the same one); ``layers`` typically the LoRA adapters (``["*lora_*"]``): the exact
            per-example gradients of the captured parameters are formed per batch, so keep them small.
        store: write to a gradient store instead of returning a :class:`~gradtrace.GradientSet`.
        store_options: how the store is written (:class:`gradtrace.StoreOptions`; shards of 4096 rows by default).
        run: ids, device, progress (:class:`gradtrace.RunOptions`).
    """
    def resolve(names: list[str]) -> dict[str, AdamState]:
        return adam_states(model, optimizer_state, names)

    return _run(model, data, _less_loss(loss), resolve, "adam", store, options, store_options, run)


def less_query_features(model: nn.Module, data: Iterable[Any], loss: Loss | LossFn | None = None, *,
                        options: CaptureOptions, store: str | Path | None = None,
                        store_options: StoreOptions | None = None, run: RunOptions | None = None
                        ) -> GradientSet | GradientStore:
    """LESS query (validation) features: plain per-example gradients, projected with the same sketch.

    Same arguments as :func:`less_features` without the optimizer state; capture the same layers with the same
    ``options.projection``.
    """
    return _run(model, data, _less_loss(loss), None, "sgd", store, options, store_options, run)


def _less_loss(loss: Loss | LossFn | None) -> Loss:
    """LESS's default per-example loss is the per-token mean."""
    return Loss(example_loss="mean") if loss is None else Loss.of(loss)


# ------------------------------------------------------------------------------------------------------ method
@register_method
class Less(Method):
    """``tau(q, z) = sum_c eta_c cos(Gamma_c(z), g_c(q))`` over LESS features (positive = helpful)."""

    name = "less"
    multi_checkpoint = True
    needs = ("checkpoints",)
    description = "LESS: learning-rate weighted cosines of Adam-preconditioned training features and query gradients"

    def __init__(self, weights: Sequence[float] | None = None) -> None:
        self.weights = rates(weights, "less learning rates") if weights is not None else None

    def checkpoint_weights(self, count: int) -> list[float]:
        if self.weights is None:
            if count == 1:
                return [1.0]
            raise MissingStage("less needs the mean learning rate of each checkpoint's epoch: "
                               "Attributor('less', train=[features_1, ...], weights=[lr_1, ...])")
        if len(self.weights) != count:
            raise ValueError(f"less: {len(self.weights)} learning rates for {count} checkpoints")
        return list(self.weights)

    def bind(self, spec: GradientSpec) -> None:
        """Refuse training gradients that are not LESS training features."""
        projection = spec.projection or {}
        if projection.get("kind") != "less":
            raise SpecMismatch("less scores LESS features: compute the training side with "
                               "gradtrace.less_features(model, optimizer, data, options=CaptureOptions(projection="
                               "sketch)) and the queries with less_query_features(model, data, options=...), the "
                               "same sketch; these training gradients are "
                               f"{'exact' if spec.projection is None else projection.get('kind')} gradients")
        if spec.convention.get("features") != "adam":
            raise SpecMismatch("less: the training side holds query features (plain gradients, "
                               f"features={spec.convention.get('features')!r}); compute it with less_features(...) "
                               "from the optimizer state")

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(queries)

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(block)

    def options(self) -> dict[str, Any]:
        return {"weights": self.weights}


def less_aggregate(scores: Any, groups: Sequence[Any] | None = None) -> Tensor:
    """LESS's selection score of each training example: ``[N]``.

    The mean score over the queries of each target task (``groups[q]`` names query ``q``'s task; default: one
    task), then the max over tasks. ``scores``: a :class:`gradtrace.Scores` with its matrix, or a ``[Q, N]``
    tensor. Select the top fraction of the pool by this value (``torch.topk``).
    """
    matrix = getattr(scores, "matrix", scores)
    if matrix is None:
        raise ValueError("less_aggregate needs the full score matrix: score(..., matrix=True)")
    groups = list(groups) if groups is not None else [0] * matrix.shape[0]
    if len(groups) != matrix.shape[0]:
        raise ValueError(f"{len(groups)} group labels for {matrix.shape[0]} queries")
    tasks = list(dict.fromkeys(groups))
    means = torch.stack([matrix[[i for i, g in enumerate(groups) if g == task]].mean(0) for task in tasks])
    return means.max(0).values
