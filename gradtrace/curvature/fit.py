"""``fit_curvature``: K-FAC / EK-FAC / dense Fisher curvature from passes over a dataset.

Pass 1 captures every example's gradient factors (exact, or LoGra-projected with their tokens kept) and
accumulates the Kronecker factors and dense Fisher blocks (:mod:`covariance`); they are eigendecomposed
in float64. For EK-FAC, pass 2 accumulates the second moments of the per-example gradients in that
eigenbasis (the eigenvalue correction of George et al. 2018). Passes run without weight gradients, like
:func:`gradtrace.collect`. With ``fisher="true"`` the labels are sampled from the model (``samples``
draws), with ``"exact"`` (classifiers) every label is weighted by its probability; ``"auto"`` chooses between
them (:func:`gradtrace.curvature.fisher.resolve_fisher`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..capture import capture
from ..capture.driver import run_capture
from ..loss.likelihoods import Likelihood
from ..options import CaptureOptions, FitOptions, takes_options, with_record
from ..projection.logra import LoGra
from ..store.spec import GradientSpec, model_fingerprint
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

    def __init__(self, kind: str, max_dense: int, wanted: set[str] | None, join_bias: bool = True) -> None:
        self.kind = kind
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


@takes_options(options=CaptureOptions, fit_options=FitOptions)
def fit_curvature(model: nn.Module, data: Iterable[Any], loss_fn=None, *, kind: str = "ekfac",
                  fisher: str = "empirical", projection: LoGra | dict | None = None,
                  layers: Sequence[Any] | None = None, exclude: Sequence[Any] | None = None,
                  spec: GradientSpec | None = None, samples: int = 1, seed: int = 0, max_dense: int = 4096,
                  damping: float = 0.1, damping_mode: str = "relative", device: Any = None,
                  join_bias: bool = True, progress: bool = False, options: CaptureOptions | None = None,
                  fit_options: FitOptions | None = None, likelihood: Likelihood | None = None) -> Curvature:
    """Fit curvature on ``data`` at the model's current weights.

    Args:
        kind: ``"kfac"``, ``"ekfac"`` (eigenvalue-corrected) or ``"fisher"`` (a dense Fisher per parameter;
            exact but quadratic in the parameter size -- the reference for small models).
        fisher: ``"empirical"``, ``"true"`` (``samples`` label draws per example), ``"exact"`` or ``"auto"``
            (exact for classifiers / regressors with few outputs, else true: see :func:`resolve_fisher`); the
            choice made is the returned curvature's ``fisher``.
        likelihood: for a custom ``loss_fn``, the distribution of its outputs that ``fisher="true"`` samples
            labels from (:func:`gradtrace.loss.likelihoods.categorical`, ``gaussian``); ``"auto"`` is then ``"true"``.
        projection: fit in a LoGra-projected space (a spec or its dict); ``spec``: the gradients the curvature
            will be used with (a store's spec): its projection and parameters are used unless given.
        max_dense: dense blocks larger than this are kept diagonal.
        join_bias: join a module's bias to its weight's Kronecker block (K-FAC's ``[a; 1]``); False keeps
            biases as dense blocks (pure weight factors, as a PCA projection basis needs).
        damping, damping_mode: stored defaults (changeable later with :meth:`Curvature.with_damping`).
        options, fit_options: ``projection``/``layers``/``exclude`` as a :class:`gradtrace.options.CaptureOptions`
            and the fit settings above as a :class:`gradtrace.options.FitOptions` (instead of the keywords); the
            resolved objects are recorded in the curvature's ``meta["gradtrace"]["options"]``.
    """
    if iter(data) is data:  # an iterator can be read once; the fit needs several passes
        data = list(data)
    first = next(iter(data), None)
    if first is None:
        raise ValueError("fit_curvature(): the data is empty")
    wanted = None
    if spec is not None:
        if projection is None and spec.projection is not None:
            if spec.projection.get("init") == "pca":
                raise ValueError("these gradients were projected with a PCA basis: pass projection=<the LoGra spec "
                                 "with its basis> to fit the curvature in the same space")
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

    def run(callback, label: str) -> None:
        for fn in passes:
            cap = capture(model, layers=layers, exclude=exclude, reduction="sum", example_loss="sum",
                          projection=projection, callbacks=[callback], keep_batches=False)
            run_capture(model, data, fn, cap, device=device, progress=progress, what=label)

    cov = _LazyCovariance(kind, max_dense, wanted, join_bias)
    run(cov, "curvature")
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
            tokens = stats.tokens / num_passes
            if tokens == 0:
                raise CurvatureError(f"fit_curvature(): no token carried gradient into {block.name} (zero curvature)")
            q_rows, e_rows = _factor_eigen(stats.rows / tokens)
            q_cols, e_cols = _factor_eigen(stats.cols / tokens)
            # the activation side is summed once per pass while the Fisher weights live on the gradient
            # side (see fisher.py): one factor num_passes too large
            grid = torch.outer(e_rows, e_cols) * (tokens / (stats.examples / num_passes)) / num_passes
            blocks[block.name] = KronEigen(block, q_rows, q_cols, grid, e_rows, e_cols)
            bases[block.name] = (q_rows, q_cols)
        else:
            total = stats.total / (stats.examples / num_passes)
            if block.diagonal:
                blocks[block.name] = DenseEigen(block, None, total)
            else:
                values, vectors = eigh(total)
                blocks[block.name] = DenseEigen(block, vectors, values)
    if kind == "ekfac":
        kron = [b for b in cov.blocks if isinstance(b, KronBlock)]
        correction = EigenCorrectionCallback(kron, bases)
        run(correction, "ekfac")
        for block in kron:
            count = correction.counts[block.name] / num_passes
            blocks[block.name].eigenvalues = correction.sums[block.name] / count
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
                       capture=options, fit=fit_options)
    return Curvature(kind, fitted_spec, blocks, fisher, damping, damping_mode, meta)


def _factor_eigen(moment: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Eigenbasis (None for a diagonal moment: the identity) and eigenvalues of a factor's second moment."""
    if moment.dim() == 1:
        return None, moment.to(torch.float32)
    values, vectors = eigh(moment)
    return vectors, values
