"""Pre-flight plans: what ``collect``, ``fit`` and ``score`` will take, before they run.

* :func:`plan` (``gradtrace collect``): counts the examples and tokens of ``data``, runs a short timed warm-up
  (the first batches, in memory) to learn the captured parameters and the dimension of each example's vector,
  and compares the store's expected size with the free space where it will be written.
* :func:`plan_fit` (``gradtrace fit``): the examples and passes of the fit, the curvature's blocks, factor
  sizes and saved size (from a timed warm-up fit on the first batches: the same blocks as the full fit), against
  the free space where it is saved.
* :func:`plan_score` (``gradtrace score``): the store's rows and dims, the blocks streamed, the memory scoring
  holds (block buffer, prepared queries, top-k state, the ``[Q, N]`` matrix when kept) against the memory
  available, the output's size, and the time from a timed first block.

The commands print these plans before the work, refuse what cannot fit (unless ``--force``), and ``--dry-run``
prints only them; this module computes, the CLI prints (:mod:`gradtrace.cli.preflight`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .capture.memory import StepMemory, estimate_step_memory
from .common.units import block_rows_for
from .options import CaptureOptions, FitOptions, Loss, RunOptions, StoreOptions
from .options.base import option_object
from .store.shards import row_bytes

__all__ = ["FitPlan", "Plan", "RECORD_BYTES_PER_ROW", "ScorePlan", "plan", "plan_fit", "plan_score"]

RECORD_BYTES_PER_ROW = 96
"""Rough bytes a row adds to its shard's JSON record (id, step, content digest): part of the size estimate."""


@dataclass(frozen=True)
class Plan:
    """What collecting ``data`` into a store takes (sizes in bytes, times in seconds)."""

    examples: int
    tokens: int | None  # tokens in the inputs (attention-mask ones when given); None for non-token inputs
    params: int  # captured parameters
    dim: int  # values per example's vector
    dtype: str  # storage dtype
    bytes_per_example: int  # on disk: the vector (and its int8 scale)
    store_bytes: int  # expected store size: vectors plus records
    free_bytes: int | None  # free space where the store goes (None: no store path given)
    seconds_per_example: float  # from the warm-up (its first batch included: an upper estimate)
    memory: StepMemory | None = None  # peak of one capture step at the largest batch (None: no transformer config)

    @property
    def fits(self) -> bool:
        """The expected store fits in the free space (True when no store path was given)."""
        return self.free_bytes is None or self.store_bytes <= self.free_bytes

    @property
    def seconds(self) -> float:
        """Estimated time to collect every example."""
        return self.examples * self.seconds_per_example


def plan(model: nn.Module, data: Iterable[Any], loss: Any = None, *, store: str | Path | None = None,
         options: CaptureOptions | None = None, store_options: StoreOptions | None = None,
         run: RunOptions | None = None, warmup_batches: int = 2) -> Plan:
    """The plan of ``collect(model, data, loss, store=..., options=..., store_options=..., run=...)``; see
    :class:`Plan`.

    ``data`` is iterated twice (counted, then its first ``warmup_batches`` batches are captured in memory):
    pass a list or a dataset, not a one-shot generator. Arguments as for :func:`gradtrace.collect`.
    """
    from .capture import capture
    from .capture.driver import run_capture

    options = option_object(options, CaptureOptions, "options")
    dtype = option_object(store_options, StoreOptions, "store_options").store_dtype
    loss = Loss.of(loss).summed("plan()")

    if warmup_batches < 1:
        raise ValueError("warmup_batches must be at least 1")
    if iter(data) is data:
        raise ValueError("plan() iterates data twice: pass a list or a dataset, not an iterator or generator")
    examples, tokens, largest = _count(data, "plan()")
    # the warm-up captures in memory as collect() does; NaN/inf gradients are collect()'s to report, not the plan's
    cap = capture(model, replace(loss, fn=None, reduction="sum"), options=replace(options, isolate_padding=True),
                  keep_batches=True)
    start = time.perf_counter()
    run = option_object(run, RunOptions, "run")
    seen = run_capture(model, islice(iter(data), warmup_batches), loss.fn, cap, replace(run, progress=False))
    seconds = (time.perf_counter() - start) / max(1, seen)
    if not cap.batches:
        raise ValueError("plan(): the warm-up batches produced no examples")
    dims = cap.batches[0].dims  # {parameter: values per example}
    dim = sum(dims.values())
    one = row_bytes(dim, dtype)
    return Plan(examples=examples, tokens=tokens, params=len(dims), dim=dim, dtype=dtype,
                bytes_per_example=one, store_bytes=examples * (one + RECORD_BYTES_PER_ROW),
                free_bytes=None if store is None else free_space(Path(store)), seconds_per_example=seconds,
                memory=None if largest is None else estimate_step_memory(model, *largest, dim))


def count_examples(data: Iterable[Any], what: str) -> tuple[int, int | None]:
    """The examples and input tokens (None for non-token inputs) of ``data``, iterated once."""
    return _count(data, what)[:2]


def _count(data: Iterable[Any], what: str) -> tuple[int, int | None, tuple[int, int] | None]:
    """:func:`count_examples`, and the ``(batch, length)`` of the batch of most tokens (None: not token inputs)."""
    from .capture.driver import batch_size

    examples, tokens, largest = 0, 0, (0, 0)
    for batch in data:
        examples += batch_size(batch)
        tokens = None if tokens is None else _add_tokens(tokens, batch)
        shape = tuple(batch["input_ids"].shape) if tokens is not None else ()
        if len(shape) == 2 and shape[0] * shape[1] > largest[0] * largest[1]:
            largest = shape  # type: ignore[assignment]
    if examples == 0:
        raise ValueError(f"{what}: the data produced no examples")
    return examples, tokens, (largest if tokens is not None and largest[0] else None)


def _add_tokens(total: int, batch: Any) -> int | None:
    """``total`` plus the batch's input tokens (attention-mask ones when given), None for non-token batches."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        return None
    mask = batch.get("attention_mask")
    return total + int(mask.sum()) if isinstance(mask, Tensor) else total + batch["input_ids"].numel()


def free_space(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


# -- gradtrace fit ----------------------------------------------------------------------------------------------
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
        from .capture.driver import batch_size

        start = time.perf_counter()
        for batch in self.batches:
            yield batch
            self.examples += batch_size(batch)
        self.seconds += time.perf_counter() - start


def plan_fit(store: Any, model: nn.Module | None = None, data: Iterable[Any] | None = None, loss_fn: Any = None, *,
             method: str = "ekfac", fisher: str = "auto", samples: int = 1, out: str | Path | None = None,
             max_dense: int = 4096, warmup_batches: int = 2, device: Any = None,
             block_rows: int | None = None, precondition: str | None = None, max_dim: int = 32768,
             mode: str = "auto", structure: str = "joint") -> FitPlan:
    """The plan of fitting ``method``'s curvature for ``store`` (a :class:`gradtrace.GradientStore` or its path).

    ``kfac``/``ekfac``/``fisher`` fit on ``data`` with ``model`` (as :func:`gradtrace.curvature.fit_curvature`
    with ``spec=store.spec``): ``data`` is counted, then a warm-up fit on its first ``warmup_batches`` batches
    gives the blocks (the same as the full fit's), the time of the data passes per example and the time of the
    eigendecompositions. ``logra`` (the dense Fisher of the stored projected gradients, no model pass) reads
    the store's first block instead; so do ``trak`` (its ``D x D`` float64 kernel, or with ``mode`` ``"dual"`` --
    ``"auto"``'s choice when the store has fewer rows than dimensions -- its ``N x N`` Gram matrix) and
    ``trackstar`` (its second moment, ``D`` values, and with ``precondition="autocorrelation"`` a kernel like
    trak's -- with ``structure="parameter"`` one per captured parameter; ``max_dense`` does not apply to them, their
    own ``max_dim`` does, per kernel). ``out``: where the fit is saved.
    """
    from .store import GradientStore

    store = store if isinstance(store, GradientStore) else GradientStore.open(store)
    free = None if out is None else free_space(Path(out))
    rows = block_rows_for(store.dim) if block_rows is None else block_rows
    if method == "logra":
        return _plan_stored_fisher(store, free, max_dense, rows, device)
    if method in ("trak", "trackstar"):
        kernel = method == "trak" or precondition == "autocorrelation"
        if mode not in ("auto", "primal", "dual") or (mode != "auto" and method != "trak"):
            raise ValueError(f"plan_fit(): mode={mode!r} applies to trak ('auto', 'primal' or 'dual')")
        chosen = mode if mode != "auto" else ("dual" if method == "trak" and len(store) < store.dim else "primal")
        if structure not in ("joint", "parameter") or (structure != "joint" and not (
                method == "trackstar" and precondition == "autocorrelation")):
            raise ValueError(f"plan_fit(): structure={structure!r} applies to trackstar's autocorrelation ('joint' "
                             "or 'parameter')")
        return _plan_stored_kernel(store, method, kernel, free, max_dim, rows, device, chosen, structure)
    if method not in ("kfac", "ekfac", "fisher"):
        raise ValueError(f"plan_fit(): method must be kfac, ekfac, fisher, logra, trak or trackstar, got {method!r}")
    if model is None or data is None:
        raise ValueError(f"plan_fit(): method {method!r} fits on data: pass model and data")
    if warmup_batches < 1:
        raise ValueError("warmup_batches must be at least 1")
    if iter(data) is data:
        raise ValueError("plan_fit() iterates data twice: pass a list or a dataset, not an iterator or generator")
    from .curvature import fit_curvature

    examples, tokens = count_examples(data, "plan_fit()")
    warm = _TimedPasses(list(islice(iter(data), warmup_batches)))
    start = time.perf_counter()
    curvature = fit_curvature(model, warm, loss_fn, spec=store.spec, run=RunOptions(device=device),
                              fit_options=FitOptions(kind=method, fisher=fisher, samples=samples, max_dense=max_dense))
    total = time.perf_counter() - start
    first_pass = _first_pass_examples(warm)
    passes = max(1, round(warm.examples / first_pass))
    factors = tensors = kron = 0
    for eig in curvature.blocks.values():
        floats, saved, is_kron = _block_sizes(eig)
        factors, tensors, kron = factors + floats, tensors + saved, kron + is_kron
    return FitPlan(method=method, examples=examples, tokens=tokens, passes=passes, blocks=len(curvature.blocks),
                   kron_blocks=kron, factor_floats=factors, curvature_bytes=4 * tensors, free_bytes=free,
                   seconds_per_example=warm.seconds / first_pass, fixed_seconds=max(0.0, total - warm.seconds))


def _first_pass_examples(warm: _TimedPasses) -> int:
    """The examples of one pass over the warm-up batches."""
    from .capture.driver import batch_size

    return max(1, sum(batch_size(b) for b in warm.batches))


def _block_sizes(eig: Any) -> tuple[int, int, int]:
    """``(factor floats, saved floats, 1 if Kronecker)`` of one fitted block: a Kronecker block's factors are its
    two eigenbases (a diagonal side: its eigenvalues), saved with the eigenvalue grid and both sides'
    eigenvalues; a dense block's factor is its eigenbasis (a diagonal one: its values), saved with them."""
    from .curvature.curvature import KronEigen

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
    from .curvature.curvature import eigh

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
        from .common.units import human_bytes

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


# -- gradtrace score --------------------------------------------------------------------------------------------
TOPK_ENTRY_BYTES = 12
"""Bytes of one kept top-k (or bottom-k) entry: a float32 score and an int64 row index."""


@dataclass(frozen=True)
class ScorePlan:
    """What scoring ``queries`` queries against a store takes (sizes in bytes, times in seconds).

    Memory is what the engine (:meth:`gradtrace.Attributor.score`) holds at its peak, whatever the store's
    size apart from the matrix: the float32 decode buffer of one block of training rows and the block's
    ``[Q, block]`` scores, the prepared queries (one float32 ``[Q, D]`` per checkpoint), the top-k and bottom-k
    state (kept and merged candidates: ``2 x Q x 2k`` entries), and the ``[Q, N]`` float32 matrix when kept.
    """

    rows: int  # training rows N
    dim: int  # values per row D
    dtype: str  # the store's storage dtype
    queries: int  # Q
    checkpoints: int  # stores scored together (TracIn checkpoints, ensemble members)
    block_rows: int
    blocks: int  # blocks streamed per store
    topk: int  # k kept per query and side (at most N)
    matrix: bool  # the full [Q, N] matrix is kept
    block_bytes: int  # decode buffer [block, D] + block scores [Q, block], float32
    query_bytes: int  # prepared queries, checkpoints x [Q, D] float32
    topk_bytes: int  # top-k and bottom-k state
    matrix_bytes: int  # [Q, N] float32 when kept, else 0
    output_bytes: int  # saved tensors (matrix, top/bottom values and indices) and the ids in scores.json
    available_bytes: int | None  # memory available where the products run (None: unknown)
    seconds_per_block: float  # reading, decoding and multiplying one block, every checkpoint (the first, timed)

    @property
    def memory_bytes(self) -> int:
        """Peak memory of the scoring loop."""
        return self.block_bytes + self.query_bytes + self.topk_bytes + self.matrix_bytes

    @property
    def fits(self) -> bool:
        """The scoring loop fits in the available memory (True when unknown)."""
        return self.available_bytes is None or self.memory_bytes <= self.available_bytes

    @property
    def seconds(self) -> float:
        """Estimated time of streaming every block (query gradients and preconditioning not included)."""
        return self.blocks * self.seconds_per_block


def plan_score(stores: Any, queries: int, *, topk: int | None = 100, matrix: bool | str = "auto",
               block_rows: int | None = None, matrix_limit: int = 2**30, device: Any = None) -> ScorePlan:
    """The plan of scoring ``queries`` queries against ``stores`` (one :class:`gradtrace.GradientStore` or path,
    or a list: checkpoints or ensemble members, scored block by block together).

    ``topk``, ``matrix``: as for :meth:`gradtrace.Attributor.score`; ``block_rows`` as for
    :class:`gradtrace.Attributor` (default: the rows of a 128 MiB float32 block) (``matrix="auto"`` keeps the
    matrix when it takes at most ``matrix_limit`` bytes, as ``Attributor(matrix_bytes=...)``). The time is that
    of the first block, read and multiplied by ``queries`` random query vectors with its top-k merged, for every
    store: needs no model and no query gradient.
    """
    from .store import GradientStore

    sources = [s if isinstance(s, GradientStore) else GradientStore.open(s)
               for s in (stores if isinstance(stores, (list, tuple)) else [stores])]
    if queries < 1:
        raise ValueError("plan_score(): no queries")
    first = sources[0]
    rows, dim = len(first), first.dim
    block_rows = block_rows_for(dim) if block_rows is None else block_rows
    if block_rows < 1:
        raise ValueError("block_rows must be at least 1")
    if rows == 0:
        raise ValueError(f"plan_score(): store {first.root} is empty")
    k = min(topk or 0, rows)
    keep = (queries * rows * 4 <= matrix_limit) if matrix == "auto" else bool(matrix)
    block = min(block_rows, rows)
    matrix_bytes = queries * rows * 4 if keep else 0
    ids = sum(len(json.dumps(i)) + 2 for i in first.ids)
    output = matrix_bytes + 2 * queries * k * TOPK_ENTRY_BYTES + ids
    return ScorePlan(rows=rows, dim=dim, dtype=first.spec.dtype, queries=queries, checkpoints=len(sources),
                     block_rows=block, blocks=math.ceil(rows / block), topk=k, matrix=keep,
                     block_bytes=4 * block * (dim + queries), query_bytes=4 * len(sources) * queries * dim,
                     topk_bytes=2 * queries * 2 * k * TOPK_ENTRY_BYTES, matrix_bytes=matrix_bytes,
                     output_bytes=output, available_bytes=available_memory(device),
                     seconds_per_block=_time_first_block(sources, queries, block, k, device))


def _time_first_block(sources: list[Any], queries: int, block: int, k: int, device: Any) -> float:
    """Seconds to read the first ``block`` rows of every store, multiply them by ``queries`` random vectors and
    take the block's top-k and bottom-k."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    prepared = torch.randn(queries, sources[0].dim, generator=torch.Generator().manual_seed(0)).to(device)
    buffer = torch.empty(block, sources[0].dim, dtype=torch.float32)
    start = time.perf_counter()
    for source in sources:
        scores = prepared @ source.read(0, block, out=buffer).to(device).t()
        if k:  # the engine takes a block's top min(k, block) before merging
            torch.topk(scores, min(k, block), dim=1)
            torch.topk(scores, min(k, block), dim=1, largest=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def available_memory(device: Any = None) -> int | None:
    """Bytes of memory available where tensors of ``device`` live: free CUDA memory, else the host's
    ``MemAvailable`` (Linux); None when unknown."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
