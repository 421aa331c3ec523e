"""``fit_curvature``: K-FAC / EK-FAC / dense Fisher curvature from passes over a dataset.

Pass 1 captures every example's gradient factors (exact, or LoGra-projected with their tokens kept) and
accumulates the Kronecker factors and dense Fisher blocks (:mod:`covariance`, in ``FitOptions.covariance_dtype``,
on the CPU with ``offload``); they are eigendecomposed in ``FitOptions.eigen_dtype`` (float64 by default). For
EK-FAC, pass 2 accumulates the second moments of the per-example gradients in that eigenbasis (the eigenvalue
correction of George et al. 2018). Passes run without weight gradients, like :func:`gradtrace.collect`. With
``fisher="true"`` the labels are sampled from the model (``samples`` draws), with ``"exact"`` (classifiers) every
label is weighted by its probability; ``"auto"`` chooses between them
(:func:`gradtrace.fit.curvature.fisher.resolve_fisher`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from ...capture import capture
from ...capture.driver import run_capture
from ...loss.functions import LossFn
from ...options import CaptureOptions, FitOptions, Loss, RunOptions, with_record
from ...options.base import option_object
from ...projection.logra import LoGra, per_layer
from ...store.spec import GradientSpec, model_fingerprint
from .blocks import DenseBlock, KronBlock, blocks_for
from .covariance import CovarianceCallback, DenseStats, EigenCorrectionCallback, KronStats
from .curvature import Curvature, CurvatureError, DenseEigen, KronEigen, eigh
from .fisher import fisher_passes, resolve_fisher

__all__ = ["fit_curvature", "modules_of"]

def modules_of(param_names: Sequence[str]) -> list[str]:
    """Module names owning the given parameter names (``"h.0.mlp.c_fc.weight" -> "h.0.mlp.c_fc"``)."""
    return sorted({name.rsplit(".", 1)[0] for name in param_names if "." in name})


class _LazyCovariance(CovarianceCallback):
    """Builds its blocks from the first captured batch (the shapes the capture actually produces)."""

    def __init__(self, kind: str, max_dense: int, wanted: set[str] | None, join_bias: bool = True,
                 dtype: torch.dtype = torch.float32, offload: bool = False) -> None:
        self.kind = kind
        self.dtype = dtype
        self.offload = offload
        self.join_bias = join_bias
        self.max_dense = max_dense
        self.wanted = wanted
        self.handlers: list = []
        self.dims: dict[str, tuple[int, ...]] | None = None
        self.blocks = []
        self.stats = {}
        self.examples = 0

    def on_capture_start(self, capture) -> None:
        self.handlers = capture.handlers

    def on_batch(self, batch, capture=None) -> None:
        if self.dims is None:
            dims = {n: pg.shape for n, pg in batch.params.items() if self.wanted is None or n in self.wanted}
            self.dims = dims
            if self.kind == "fisher":
                blocks = [DenseBlock(n, _numel(s), diagonal=_numel(s) > self.max_dense) for n, s in dims.items()]
            else:
                blocks = blocks_for(self.handlers, dims, projected=batch.projection is not None or not self.join_bias,
                                    max_dense=self.max_dense)
            self.blocks = blocks
            self.stats = {b.name: (KronStats(b) if isinstance(b, KronBlock) else DenseStats(b)) for b in blocks}
            self.projection = batch.projection
            self.convention = batch.convention.to_dict()
        super().on_batch(batch, capture)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def fit_curvature_from(model: nn.Module, data: Iterable[Any], loss: Any, spec: GradientSpec | None,
                       settings: dict[str, Any]) -> Curvature:
    """:func:`fit_curvature` with its settings as one flat dict (a method's own constructor and ``fit`` keywords:
    ``kind``, ``fisher``, ``samples``, ``projection``, ``layers``, ``device``, ``likelihood``...), each sorted into
    the option object it belongs to; an unknown key is a TypeError naming it."""
    groups: dict[str, dict[str, Any]] = {"capture": {}, "fit": {}, "run": {}}
    owners = {"capture": CaptureOptions, "fit": FitOptions, "run": RunOptions}
    likelihood = settings.get("likelihood")
    for key, value in settings.items():
        if key == "likelihood":
            continue
        owner = next((g for g, cls in owners.items() if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"fit(): unknown setting {key!r}")
        groups[owner][key] = value
    if likelihood is not None:
        loss = replace(Loss.of(loss), likelihood=likelihood)
    return fit_curvature(model, data, loss, options=CaptureOptions(**groups["capture"]),
                         fit_options=FitOptions(**groups["fit"]), run=RunOptions(**groups["run"]), spec=spec)


def fit_curvature(model: nn.Module, data: Iterable[Any], loss: Loss | LossFn | None = None, *,
                  options: CaptureOptions | None = None, fit_options: FitOptions | None = None,
                  run: RunOptions | None = None, spec: GradientSpec | None = None) -> Curvature:
    """Fit curvature on ``data`` at the model's current weights.

    Args:
        model, data: the model and an iterable of batches (read several times: an iterator is listed first).
        loss: the per-example loss (:class:`gradtrace.Loss`, or its ``fn``): ``fn``, and for ``fisher="true"`` with
            a custom ``fn`` the ``likelihood`` of its outputs that labels are sampled from
            (:func:`gradtrace.loss.likelihoods.categorical`, ``gaussian``; ``fisher="auto"`` is then ``"true"``).
        options: what is captured (:class:`gradtrace.CaptureOptions`): layers, exclude, and a LoGra
            ``projection`` (a spec or its dict) to fit in the projected space.
        fit_options: which curvature and how (:class:`gradtrace.FitOptions`: kind, fisher, samples, seed,
            max_dense, damping, damping_mode, join_bias); the fisher chosen is the returned curvature's ``fisher``.
        run: device and progress (:class:`gradtrace.RunOptions`).
        spec: the gradients the curvature will be used with (a store's spec): its projection and parameters are
            used unless given.

    Returns:
        the :class:`Curvature`; the resolved option objects are recorded in its ``meta["gradtrace"]["options"]``.
    """
    options = option_object(options, CaptureOptions, "options")
    fit_options = option_object(fit_options, FitOptions, "fit_options")
    run_options = option_object(run, RunOptions, "run")
    loss = Loss.of(loss).summed("fit_curvature()")
    loss_fn, likelihood = loss.fn, loss.likelihood
    projection, layers = per_layer(options.projection, "fit_curvature()"), options.layers
    kind, fisher, samples, seed = fit_options.kind, fit_options.fisher, fit_options.samples, fit_options.seed
    max_dense, join_bias = fit_options.max_dense, fit_options.join_bias
    if iter(data) is data:  # an iterator can be read once; the fit needs several passes
        data = list(data)
    first = next(iter(data), None)
    if first is None:
        raise ValueError("fit_curvature(): the data is empty")
    wanted = None
    if spec is not None:
        if projection is None and spec.projection is not None:
            if spec.projection.get("init") == "pca":
                raise ValueError("these gradients were projected with a PCA basis: pass "
                                 "options=CaptureOptions(projection=<the LoGra spec with its basis>) to fit the "
                                 "curvature in the same space")
            projection = spec.projection
        wanted = {name for name, _ in spec.params}
        if layers is None and all("." in name for name in wanted):  # else the model itself is a layer
            layers = modules_of(list(wanted))
    if isinstance(projection, dict):
        projection = LoGra.from_dict(projection)
    if projection is not None:
        projection = LoGra(**{**projection.__dict__, "keep_tokens": True})
    fisher, classes = resolve_fisher(fisher, loss_fn, model, first, likelihood)
    passes = fisher_passes(loss_fn, fisher, first, samples=samples, seed=seed, num_classes=classes,
                           likelihood=likelihood)

    def pass_over(callback, label: str) -> None:
        for fn in passes:
            cap = capture(model, replace(loss, fn=None, likelihood=None, reduction="sum"),
                          options=replace(options, layers=layers, projection=projection), callbacks=[callback],
                          keep_batches=False)
            run_capture(model, data, fn, cap, run_options, what=label)

    stat_dtype, eigen_dtype = getattr(torch, fit_options.covariance_dtype), getattr(torch, fit_options.eigen_dtype)
    cov = _LazyCovariance(kind, max_dense, wanted, join_bias, stat_dtype, fit_options.offload)
    pass_over(cov, "curvature")
    if cov.dims is None:
        raise ValueError("fit_curvature(): no gradients were captured")
    missing = sorted(wanted - set(cov.dims)) if wanted is not None else []
    if missing:
        raise ValueError(f"fit_curvature(): the gradients to precondition include {missing[:3]}, which this "
                         "capture does not produce")
    num_passes = len(passes)
    examples = cov.examples / num_passes
    blocks: dict[str, KronEigen | DenseEigen] = {}
    bases = {}
    for block in cov.blocks:
        stats = cov.stats[block.name]
        if isinstance(block, KronBlock):
            tokens = float(stats.tokens) / num_passes
            if tokens == 0:
                raise CurvatureError(f"fit_curvature(): no token carried gradient into {block.name} (zero curvature)")
            q_rows, e_rows = _factor_eigen(stats.rows / tokens, eigen_dtype)
            q_cols, e_cols = _factor_eigen(stats.cols / tokens, eigen_dtype)
            # the activation side is summed once per pass while the Fisher weights live on the gradient
            # side (see fisher.py): one factor num_passes too large
            grid = torch.outer(e_rows, e_cols) * (tokens / (stats.examples / num_passes)) / num_passes
            blocks[block.name] = KronEigen(block, q_rows, q_cols, grid, e_rows, e_cols)
            bases[block.name] = (q_rows, q_cols)
        else:
            total = stats.total / (stats.examples / num_passes)
            if block.diagonal:
                blocks[block.name] = DenseEigen(block, None, total.to(torch.float32))
            else:
                values, vectors = eigh(total, eigen_dtype)
                blocks[block.name] = DenseEigen(block, vectors, values)
    if kind == "ekfac":
        kron = [b for b in cov.blocks if isinstance(b, KronBlock)]
        correction = EigenCorrectionCallback(kron, bases, dtype=stat_dtype, offload=fit_options.offload)
        pass_over(correction, "ekfac")
        for block in kron:
            count = correction.counts[block.name] / num_passes
            blocks[block.name].eigenvalues = (correction.sums[block.name] / count).to(torch.float32)
    params = [(name, _numel(shape)) for name, shape in cov.dims.items()]
    fitted_spec = GradientSpec(params=params, projection=cov.projection,
                               convention=spec.convention if spec is not None else cov.convention,
                               model=model_fingerprint(model))
    if spec is not None:
        order = [n for n, _ in spec.params]
        fitted_spec = GradientSpec([p for n in order for p in params if p[0] == n], cov.projection,
                                   spec.convention, fitted_spec.model)
        blocks = {n: b for n, b in blocks.items() if n in wanted}
    meta = with_record({"examples": examples, "passes": num_passes, "samples": samples, "seed": seed},
                       capture=options, fit=fit_options, loss=loss)
    return Curvature(kind, fitted_spec, blocks, fisher, fit_options.damping, fit_options.damping_mode, meta)


def _factor_eigen(moment: torch.Tensor, dtype: torch.dtype = torch.float64
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Eigenbasis (None for a diagonal moment: the identity) and eigenvalues of a factor's second moment
    (eigendecomposed in ``dtype``, returned in float32)."""
    if moment.dim() == 1:
        return None, moment.to(torch.float32)
    values, vectors = eigh(moment, dtype)
    return vectors, values
