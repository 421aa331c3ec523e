"""The printed pre-flight of ``gradtrace fit`` and ``gradtrace score``: their plans (computed by
:func:`gradtrace.plan_fit` and :func:`gradtrace.plan_score`), the refusals of what cannot fit (unless
``--force``), and the query count a score plan needs before any model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .console import console, human_bytes
from .errors import CliError
from .groups import DataOptions

__all__ = ["check_fit_plan", "check_score_plan", "count_records", "fit_plan_lines", "print_plan",
           "score_plan_lines"]


def print_plan(text: str) -> None:
    """Print a plan as is (no markup, no folding)."""
    console().print(text, markup=False, highlight=False, soft_wrap=True)


def fit_plan_lines(planned: Any, out: Path) -> str:
    """The printed plan of ``gradtrace fit``."""
    tokens = "" if planned.tokens is None else f", {planned.tokens:,} tokens"
    free = "" if planned.free_bytes is None else f" ({human_bytes(planned.free_bytes)} free there)"
    stored = planned.method in ("logra", "trak", "trackstar")
    source = "stored rows" if stored else "examples"
    passes = f"{planned.passes} pass{'' if planned.passes == 1 else 'es'}"
    what = "curvature" if planned.method not in ("trak", "trackstar") else "fit"
    itemsize = planned.factor_itemsize
    form = {"primal": " (primal: the D x D kernel)",
            "dual": " (dual: the N x N Gram matrix; each scoring reads the store twice more)"}.get(
        planned.kernel_mode or "", "")
    return "\n".join([
        f"Plan: {planned.method} {what}{form} over {planned.examples:,} {source}{tokens}; {passes}",
        f"  blocks      {planned.blocks:,} ({planned.kron_blocks:,} Kronecker-factored), factors "
        f"{planned.factor_floats:,} {'floats' if itemsize == 4 else 'float64 values'} "
        f"({human_bytes(itemsize * planned.factor_floats)})",
        f"  {what:<11} about {human_bytes(planned.curvature_bytes)} in {out}{free}",
        *([] if planned.memory_bytes is None else [
            f"  memory      about {human_bytes(planned.memory_bytes)} at the peak ("
            + ("the kernel, its eigenvectors" if planned.blocks == 1 else
               f"the {planned.blocks:,} kernels, the widest one's eigenvectors")
            + " and the eigensolver's workspace)" + ("" if planned.available_bytes is None else
                                               f" ({human_bytes(planned.available_bytes)} available)")]),
        f"  time        about {planned.seconds:,.0f} s ({planned.seconds_per_example * 1e3:,.2f} ms/example over "
        f"every pass + {planned.fixed_seconds:,.1f} s of eigendecompositions, from a warm-up)"])


def check_fit_plan(planned: Any, out: Path, force: bool) -> None:
    """Refuse a curvature that cannot be saved in the free space of ``out``, or a fit whose planned peak memory
    exceeds what is available (unless ``--force``)."""
    if not planned.fits_memory and not force:
        raise CliError(f"the {planned.method} fit needs about {human_bytes(planned.memory_bytes)} of memory at its "
                       f"peak but {human_bytes(planned.available_bytes or 0)} is available: collect with a lower "
                       "--rank (the kernel grows with its dimensions squared), or pass --force")
    if not planned.fits and not force:
        raise CliError(f"the curvature needs about {human_bytes(planned.curvature_bytes)} but {out} has "
                       f"{human_bytes(planned.free_bytes or 0)} free: free space, choose another --out, or pass "
                       "--force")


def score_plan_lines(planned: Any) -> str:
    """The printed plan of ``gradtrace score``."""
    stores = "" if planned.checkpoints == 1 else f" x {planned.checkpoints} stores"
    kept = ("the full matrix" if planned.matrix else "no matrix") + \
        (f", top/bottom {planned.topk}" if planned.topk else "")
    available = "" if planned.available_bytes is None else \
        f" ({human_bytes(planned.available_bytes)} available)"
    return "\n".join([
        f"Plan: {planned.queries:,} queries against {planned.rows:,} training rows x {planned.dim:,} dims "
        f"({planned.dtype}){stores}",
        f"  blocks      {planned.blocks:,} of {planned.block_rows:,} rows; keeps {kept}",
        f"  memory      about {human_bytes(planned.memory_bytes)}{available}: block "
        f"{human_bytes(planned.block_bytes)}, queries {human_bytes(planned.query_bytes)}, top-k "
        f"{human_bytes(planned.topk_bytes)}, matrix {human_bytes(planned.matrix_bytes)}",
        f"  output      about {human_bytes(planned.output_bytes)}",
        f"  time        about {planned.seconds:,.1f} s streaming ({planned.seconds_per_block:,.3f} s/block, from the "
        "first block; query gradients not included)"])


def check_score_plan(planned: Any, force: bool) -> None:
    """Refuse scoring whose memory (the ``[Q, N]`` matrix above all) exceeds what is available (unless
    ``--force``)."""
    if planned.fits or force:
        return
    fix = "--matrix no (keep the top-k only)" if planned.matrix else "a smaller --block-rows"
    raise CliError(f"scoring needs about {human_bytes(planned.memory_bytes)} of memory (matrix "
                   f"{human_bytes(planned.matrix_bytes)}) but {human_bytes(planned.available_bytes or 0)} is "
                   f"available: pass {fix}, score fewer queries at a time, or pass --force")


def count_records(path: Path, opts: DataOptions, what: str) -> int:
    """The records of a data file (one example each), counted without a tokenizer or a model."""
    from ..data.errors import DataError
    from ..data.sources import open_source

    try:
        source = open_source(path, split=opts.split, text_field=opts.text_field, what=what)
        return sum(len(chunk.records) for chunk in source.chunks)
    except DataError as err:
        raise CliError(str(err)) from None
