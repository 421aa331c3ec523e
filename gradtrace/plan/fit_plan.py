"""The plan of a fit: the curvature (a timed warm-up fit) or a method's kernel (timed on the store's first block)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..common.units import block_rows_for
from ..options import FitOptions, RunOptions
from .collect_plan import count_examples
from .resources import available_memory, free_space

__all__ = ["FitPlan", "KernelTooLarge", "WARMUP_BATCHES", "plan_fit"]


@dataclass(frozen=True)
class FitPlan:
    """What fitting a curvature for a store takes (sizes in bytes, times in seconds)."""

    method: str  # kfac, ekfac, fisher (a dense Fisher per parameter), logra, trak or trackstar (from the store)
    examples: int  # examples each pass goes over (the store's rows for logra, trak, trackstar)
    tokens: int | None  # input tokens of those examples (None: not token inputs, or logra)
    passes: int  # passes over the data: 2 for EK-FAC, times the label samples of a true Fisher
    blocks: int  # curvature blocks (one per matrix parameter, one per other parameter)
    kron_blocks: int  # of which Kronecker-factored
    factor_floats: int  # float32 values of the factors: d_out^2 + d_in^2 per Kronecker block (d for a diagonal
    # side), dim^2 per dense block (dim for a diagonal one); in the projected space under LoGra
    curvature_bytes: int  # saved eigendata: eigenvectors and eigenvalues (float32)
    free_bytes: int | None  # free space where it is saved (None: no output path given)
    seconds_per_example: float  # every pass over one example (from the warm-up)
    fixed_seconds: float  # once: eigendecompositions (from the warm-up, whose blocks have the full fit's sizes)
    factor_itemsize: int = 4  # bytes per factor value: 8 for the float64 D x D kernel of trak / trackstar
    memory_bytes: int | None = None  # peak memory of the fit where it dominates (a D x D kernel), else None
    kernel_mode: str | None = None  # trak: "primal" (D x D kernel) or "dual" (N x N Gram matrix)
    available_bytes: int | None = None  # memory available where the fit runs (None: unknown or not planned)

    @property
    def fits_memory(self) -> bool:
        """The fit's planned peak memory fits in the available memory (True when either is unknown)."""
        return self.memory_bytes is None or self.available_bytes is None or self.memory_bytes <= self.available_bytes

    @property
    def fits(self) -> bool:
        """The saved curvature fits in the free space (True when no output path was given)."""
        return self.free_bytes is None or self.curvature_bytes <= self.free_bytes

    @property
    def seconds(self) -> float:
        """Estimated time of the whole fit."""
        return self.examples * self.seconds_per_example + self.fixed_seconds


class _TimedPasses:
    """``data`` as a re-iterable that adds up the time of its complete passes (the fit's data passes) and the
    examples in them."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.seconds, self.examples = batches, 0.0, 0

    def __iter__(self) -> Any:
        from ..capture.driver import batch_size

        start = time.perf_counter()
        for batch in self.batches:
            yield batch
            self.examples += batch_size(batch)
        self.seconds += time.perf_counter() - start


WARMUP_BATCHES = 2
"""Batches of the timed warm-up fit of a curvature plan (its blocks are the full fit's; the time per example is
that of these batches' passes)."""

_KIND_OF = {"kfac": "kfac", "ekfac": "ekfac", "fisher": "fisher", "ggn": "fisher"}


def plan_fit(store: Any, model: nn.Module | None = None, data: Iterable[Any] | None = None, loss_fn: Any = None, *,
             method: Any = "ekfac", options: FitOptions | None = None, out: str | Path | None = None,
             run: RunOptions | None = None) -> FitPlan:
    """The plan of fitting ``method`` for ``store`` (a :class:`gradtrace.GradientStore` or its path).

    Args:
        store: the training gradients the fit is for.
        model, data, loss_fn: the model pass of a curvature fit (``kfac``, ``ekfac``, ``fisher``/``ggn``, as
            :func:`gradtrace.fit.fit_curvature` with ``spec=store.spec``); ``data`` is iterated twice (counted,
            then a warm-up fit on its first :data:`WARMUP_BATCHES` batches gives the blocks -- the full fit's --,
            the time per example of the data passes and the time of the eigendecompositions): a list or a dataset.
            ``logra`` (the dense Fisher of the stored projected gradients), ``trak`` and ``trackstar`` read the
            store's first block instead and take no model.
        method: a name (``"kfac"``, ``"ekfac"``, ``"fisher"`` or ``"ggn"``, ``"logra"``, ``"trak"``,
            ``"trackstar"``) or a method object whose settings the plan follows: ``TRAK(mode="dual", max_dim=...)``
            (``"auto"``: the ``N x N`` Gram matrix when the store has fewer rows than dimensions),
            ``TrackStar(precondition="autocorrelation", structure="parameter")`` (a kernel like trak's, one per
            parameter), ``EKFAC(fisher="true", samples=2)``.
        options: the curvature fit's :class:`~gradtrace.options.FitOptions` (``fisher``, ``samples``,
            ``max_dense``, ``covariance_dtype``...; its ``kind`` is ``method``'s). Default: the method's own
            settings (``fisher="auto"`` for kfac / ekfac, ``"exact"`` for ggn).
        out: where the fit is saved (its free space is compared with the fit's size).
        run: the device the fit runs on (``RunOptions(device=...)``).

    Raises:
        ValueError: an unknown method, a model-pass method without ``model``/``data``, a one-shot iterator.
        KernelTooLarge: a trak / trackstar kernel beyond the method's ``max_dim``.
    """
    from ..fit.methods import Method, get_method
    from ..store import GradientStore

    store = store if isinstance(store, GradientStore) else GradientStore.open(store)
    if isinstance(method, str):
        known = (*_KIND_OF, "logra", "trak", "trackstar")
        if method not in known:
            raise ValueError(f"plan_fit(): method must be one of {', '.join(known)}, got {method!r}")
        method = get_method("ggn" if method == "fisher" else method)
    elif not isinstance(method, Method):
        raise TypeError(f"plan_fit(): method must be a method name or object, got {type(method).__name__}")
    name = method.name
    device = (run or RunOptions()).device
    free = None if out is None else free_space(Path(out))
    rows = block_rows_for(store.dim)
    if name == "logra":
        max_dense = options.max_dense if options is not None else method.fit_options["max_dense"]
        return _plan_stored_fisher(store, free, max_dense, rows, device)
    if name == "trak":
        mode = method.mode if method.mode != "auto" else ("dual" if len(store) < store.dim else "primal")
        return _plan_stored_kernel(store, name, True, free, method.max_dim, rows, device, mode)
    if name == "trackstar":
        kernel = method.precondition == "autocorrelation"
        return _plan_stored_kernel(store, name, kernel, free, method.max_dim, rows, device, "primal",
                                   method.structure if kernel else "joint")
    if name not in _KIND_OF:
        raise ValueError(f"plan_fit(): method {name!r} has no fit to plan (kfac, ekfac, ggn, logra, trak, trackstar)")
    if model is None or data is None:
        raise ValueError(f"plan_fit(): method {name!r} fits on data: pass model and data")
    if iter(data) is data:
        raise ValueError("plan_fit() iterates data twice: pass a list or a dataset, not an iterator or generator")
    kind = _KIND_OF[name]
    fit_options = replace(options, kind=kind) if options is not None else FitOptions(
        kind=kind, fisher=method.fisher, samples=method.fit_options["samples"], seed=method.fit_options["seed"],
        max_dense=method.fit_options["max_dense"])
    from ..fit.curvature import fit_curvature

    examples, tokens = count_examples(data, "plan_fit()")
    warm = _TimedPasses(list(islice(iter(data), WARMUP_BATCHES)))
    start = time.perf_counter()
    curvature = fit_curvature(model, warm, loss_fn, spec=store.spec, run=run or RunOptions(),
                              fit_options=fit_options)
    total = time.perf_counter() - start
    first_pass = _first_pass_examples(warm)
    passes = max(1, round(warm.examples / first_pass))
    factors = tensors = kron = 0
    for eig in curvature.blocks.values():
        floats, saved, is_kron = _block_sizes(eig)
        factors, tensors, kron = factors + floats, tensors + saved, kron + is_kron
    return FitPlan(method=kind, examples=examples, tokens=tokens, passes=passes, blocks=len(curvature.blocks),
                   kron_blocks=kron, factor_floats=factors, curvature_bytes=4 * tensors, free_bytes=free,
                   seconds_per_example=warm.seconds / first_pass, fixed_seconds=max(0.0, total - warm.seconds),
                   factor_itemsize=8 if fit_options.covariance_dtype == "float64" else 4)


def _first_pass_examples(warm: _TimedPasses) -> int:
    """The examples of one pass over the warm-up batches."""
    from ..capture.driver import batch_size

    return max(1, sum(batch_size(b) for b in warm.batches))


def _block_sizes(eig: Any) -> tuple[int, int, int]:
    """``(factor floats, saved floats, 1 if Kronecker)`` of one fitted block: a Kronecker block's factors are its
    two eigenbases (a diagonal side: its eigenvalues), saved with the eigenvalue grid and both sides'
    eigenvalues; a dense block's factor is its eigenbasis (a diagonal one: its values), saved with them."""
    from ..fit.curvature.curvature import KronEigen

    numel = lambda t: 0 if t is None else t.numel()
    if isinstance(eig, KronEigen):
        rows, cols = eig.block.shape
        factors = (numel(eig.q_rows) or rows) + (numel(eig.q_cols) or cols)
        saved = numel(eig.q_rows) + numel(eig.q_cols) + numel(eig.eigenvalues) + numel(eig.rows_eig) + \
            numel(eig.cols_eig)
        return factors, saved, 1
    return numel(eig.q) or numel(eig.eigenvalues), numel(eig.q) + numel(eig.eigenvalues), 0


def _plan_stored_fisher(store: Any, free: int | None, max_dense: int, block_rows: int, device: Any) -> FitPlan:
    """The plan of logra's dense Fisher of the stored gradients: one pass over the store's rows (timed on its first
    block) and one eigendecomposition per parameter of at most ``max_dense`` values (timed: the warm-up's)."""
    from ..fit.curvature.curvature import eigh

    if store.spec.projection is None:
        raise ValueError("plan_fit(): logra fits in a projected space; this store holds exact gradients")
    stop = min(len(store), block_rows)
    start = time.perf_counter()
    block = store.read(0, stop, device).to(torch.float32)
    moments = {}
    for name, (first, last) in store.spec.offsets().items():
        part = block[:, first:last]
        moments[name] = part.pow(2).sum(0) if last - first > max_dense else part.t() @ part
    per_row = (time.perf_counter() - start) / max(1, stop)
    start = time.perf_counter()
    factors = saved = 0
    for moment in moments.values():
        if moment.dim() == 2:
            eigh(moment.cpu())
        factors += moment.numel()
        saved += moment.numel() + (moment.shape[0] if moment.dim() == 2 else 0)
    return FitPlan(method="logra", examples=len(store), tokens=None, passes=1, blocks=len(moments), kron_blocks=0,
                   factor_floats=factors, curvature_bytes=4 * saved, free_bytes=free, seconds_per_example=per_row,
                   fixed_seconds=time.perf_counter() - start)


class KernelTooLarge(ValueError):
    """A ``D x D`` float64 kernel (trak, trackstar's autocorrelation) beyond ``max_dim``."""

    def __init__(self, method: str, dim: int, max_dim: int, dual: bool = False, parameter: str | None = None) -> None:
        from ..common.units import human_bytes

        self.method, self.dim, self.max_dim, self.bytes, self.dual = method, dim, max_dim, 8 * dim * dim, dual
        self.parameter = parameter  # trackstar's autocorrelation per parameter: the widest one
        self.what = ("trak's Gram matrix" if dual else "trak's kernel") if method == "trak" else \
            "trackstar's autocorrelation" + (f" of parameter {parameter}" if parameter else "")
        of = f"{dim:,} training examples" if dual else f"{dim:,}-dimensional gradients"
        super().__init__(f"plan_fit(): {self.what} of {of} takes {human_bytes(self.bytes)} (float64), beyond "
                         f"max_dim={max_dim:,}; collect projected gradients "
                         "(options=CaptureOptions(projection=gradtrace.LoGra(rank=...))) or raise max_dim=")


KERNEL_TIMED_DIM = 512
"""The size of the eigendecomposition timed for a kernel plan; a ``D x D`` one is scaled by ``(D / 512)^3``."""


def _plan_stored_kernel(store: Any, method: str, kernel: bool, free: int | None, max_dim: int, block_rows: int,
                        device: Any, mode: str = "primal", structure: str = "joint") -> FitPlan:
    """The plan of trak's kernel or trackstar's fit from the stored rows. With a ``D x D`` kernel (``mode``
    ``"primal"``): one pass accumulating ``Phi^T Phi`` (timed on the store's first block); with trak's ``N x N`` Gram
    matrix (``"dual"``): every pair of blocks once (``b (b + 1) / 2`` block products, timed on the first block
    against itself); then one float64 eigendecomposition (timed at :data:`KERNEL_TIMED_DIM`, scaled cubically).
    trackstar's autocorrelation per parameter (``structure="parameter"``): a kernel per parameter, each
    decomposed in turn. trackstar alone reads only the optimizer state."""
    dim, rows = store.dim, len(store)
    saved = 4 * dim if method == "trackstar" else 0  # the second moment's denominator, float32
    if not kernel:
        return FitPlan(method=method, examples=rows, tokens=None, passes=0, blocks=1, kron_blocks=0,
                       factor_floats=dim, curvature_bytes=saved, free_bytes=free, seconds_per_example=0.0,
                       fixed_seconds=0.0)
    names = [name for name, _ in store.spec.params] if structure == "parameter" else [None]
    sizes = [d for _, d in store.spec.params] if structure == "parameter" else [dim if mode == "primal" else rows]
    size = max(sizes)  # the widest kernel, decomposed alone
    if size > max_dim:
        raise KernelTooLarge(method, size, max_dim, dual=mode == "dual", parameter=names[sizes.index(size)])
    stop = min(rows, block_rows)
    start = time.perf_counter()
    block = store.read(0, stop, device).to(torch.float64)
    if mode == "dual":
        block @ block.t()
    else:
        for part in block.split(sizes, dim=1):  # the whole row when joint
            part.t() @ part
    first = time.perf_counter() - start
    blocks = -(-rows // stop)
    passes = 1 if mode == "primal" else blocks  # the most times a row is read (the Gram: once per block pair)
    per_row = first / max(1, stop) if mode == "primal" else first * blocks * (blocks + 1) / 2 / max(1, rows)
    timed = min(size, KERNEL_TIMED_DIM)
    sample = torch.randn(timed, timed, dtype=torch.float64)
    start = time.perf_counter()
    torch.linalg.eigh(sample @ sample.t())
    eigh_seconds = (time.perf_counter() - start) * sum((s / timed) ** 3 for s in sizes)
    # peak, float64: every kernel (one when joint), then while the widest is decomposed its eigenvectors and LAPACK's
    # divide-and-conquer workspace (about 2 size^2 more), next to the block(s) of rows read at once
    squares = sum(s * s for s in sizes)
    memory = 8 * (squares + 3 * size * size) + 8 * stop * dim * (1 if mode == "primal" else 2)
    saved += 8 * (squares + sum(sizes))  # (a reweighted dual fit saves N more: the rows' 1 - p, float64)
    return FitPlan(method=method, examples=rows, tokens=None, passes=passes, blocks=len(sizes), kron_blocks=0,
                   factor_floats=squares, curvature_bytes=saved, free_bytes=free, seconds_per_example=per_row,
                   fixed_seconds=eigh_seconds, factor_itemsize=8, memory_bytes=memory,
                   available_bytes=available_memory(device), kernel_mode=mode if method == "trak" else None)
