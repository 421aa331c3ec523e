"""``gradtrace index STORE --out INDEX``: an approximate nearest-neighbour index over a gradient store.

``gradtrace score STORE QUERIES --index INDEX --rerank R`` then shortlists ``R`` rows per query from the index
and re-scores them exactly from the store (see :mod:`gradtrace.score.shortlist`). One index of raw rows serves
grad_dot and the influence methods (kfac, ekfac, ggn, logra: the curvature is applied to the query side);
grad_cos needs an index built with ``--normalize``. Needs FAISS: ``pip install 'gradtrace[index]'``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..common.paths import why_missing
from ..options import index as api
from .commands import Group, api_field, cli, progress_flag, resolved
from .config import write_resolved
from .console import Phases, console, human_bytes
from .errors import CliError
from .outputs import check_output_dir

__all__ = ["OPTIONS", "IndexCommand", "run"]


@dataclass(kw_only=True)
class BuildOptions(Group):
    """What kind of index is built and how: the Python API's :class:`gradtrace.options.index.IndexOptions`, and
    the rows read per block."""

    panel = "Index"
    kind: Literal["auto", "flat", "ivfpq"] = field(default="auto", metadata=api_field(api.IndexOptions, "kind"))
    normalize: bool = field(default=False, metadata=api_field(api.IndexOptions, "normalize", "--normalize"))
    nlist: int | None = field(default=None, metadata=api_field(api.IndexOptions, "nlist"))
    m: int | None = field(default=None, metadata=api_field(api.IndexOptions, "m", "--m"))
    nbits: int | None = field(default=None, metadata=api_field(api.IndexOptions, "nbits"))
    fast_scan: bool = field(default=False, metadata=api_field(api.IndexOptions, "fast_scan", "--fast-scan"))
    train_rows: int = field(default=65536, metadata=api_field(api.IndexOptions, "train_rows"))
    seed: int = field(default=0, metadata=api_field(api.IndexOptions, "seed"))
    block_rows: int = field(default=65536, metadata=cli("Store rows read and added per block (bounds memory).",
                                                        min=1))

    def index_options(self) -> api.IndexOptions:
        """The Python API's :class:`gradtrace.options.index.IndexOptions` of these options (``--kind auto`` by
        default, where ``build_index``'s default is flat)."""
        return api.IndexOptions(kind=self.kind, normalize=self.normalize, nlist=self.nlist, m=self.m,
                                nbits=self.nbits, train_rows=self.train_rows, seed=self.seed,
                                fast_scan=self.fast_scan)


@dataclass(kw_only=True)
class IndexCommand:
    """Options of ``gradtrace index``."""

    store: Path = field(metadata=cli("Gradient store to index (written by gradtrace collect).", argument=True,
                                     metavar="STORE"))
    out: Path = field(metadata=cli("Directory to save the index in.", "--out", "-o", metavar="INDEX"))
    build_options: BuildOptions
    overwrite: bool = field(default=False, metadata=cli("Replace an index already saved in --out."))
    add_norms: bool = field(default=False, metadata=cli(
        "Add every row's L2 norm to the index already saved in --out (one pass over STORE, no rebuild): what "
        "gradtrace score --norm-rows needs from an index built before norms were recorded. Refused for an index "
        "of another store.", "--add-norms"))
    progress: bool = progress_flag("Show a progress bar.")


OPTIONS = IndexCommand


def run(opts: IndexCommand) -> None:
    """Build an approximate index of a gradient store for gradtrace score --index.

    The index shortlists rows; gradtrace score --index INDEX --rerank R re-scores the R shortlisted rows of each
    query exactly from the store. It records the store's fingerprint and is refused once the store changes.

    Example: gradtrace index ./store --out ./index --kind ivfpq
    then:    gradtrace score ./store queries.jsonl --index ./index --rerank 1000 --norm-rows 10000 --out ./scores
    An index built before row norms were recorded: gradtrace index ./store --out ./index --add-norms
    """
    from ..score.index import FaissMissing, build_index
    from ..score.index_training import FaissTrainingWarning
    from ..store import GradientStore

    b = opts.build_options
    index_options = b.index_options()
    if not opts.store.exists():
        raise CliError(f"store {opts.store} {why_missing(opts.store)}")
    if opts.add_norms:
        _add_norms(opts)
        return
    check_output_dir(opts.out, "--out", stem="index", what="an index", overwrite=opts.overwrite)
    phases = Phases()
    with phases("open store"):
        store = GradientStore.open(opts.store)
    try:
        with phases("build"), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", FaissTrainingWarning)
            index = build_index(store, index_options, block_rows=b.block_rows, progress=opts.progress)
    except FaissMissing as err:
        raise CliError(str(err)) from None
    _say_warnings(said)
    with phases("save"):
        index.save(opts.out, overwrite=opts.overwrite)
        written = write_resolved(opts.out, "index", resolved(opts))
    params = index.params
    out = console()
    detail = "exact inner product" if params.kind == "flat" else \
        f"nlist {params.nlist}, PQ {params.m}x{params.nbits} bits{' fast-scan' if params.fast_scan else ''}, " \
        f"nprobe {params.nprobe} by default, trained on {params.train_rows:,} rows"
    size = sum(f.stat().st_size for f in opts.out.iterdir() if f.is_file())
    out.print(f"Indexed {len(index):,} rows of {opts.store} ({params.kind}: {detail}); saved in {opts.out}")
    if index.meta.get("auto_kind"):
        out.print(f"  kind        {params.kind}, chosen by --kind auto: {index.meta['auto_kind']}", markup=False,
                  soft_wrap=True)
    rows = "normalized (for grad_cos)" if params.normalize else "raw (grad_dot, kfac, ekfac, ggn, logra)"
    out.print(f"  rows        {rows}")
    out.print(f"  size        {human_bytes(size)}")
    out.print(f"  config      {written}")
    out.print(f"Next: gradtrace score {opts.store} QUERIES --index {opts.out} --rerank 1000 --out SCORES_DIR")
    if opts.progress:
        console(stderr=True).print(phases.table())


def _say_warnings(said: list[warnings.WarningMessage]) -> None:
    """FAISS's training warning as one ``Warning: ...`` line on stderr; other warnings pass on as they are."""
    from ..score.index_training import FaissTrainingWarning

    for warning in said:
        if issubclass(warning.category, FaissTrainingWarning):
            console(stderr=True).print(f"Warning: {warning.message}", style="yellow", markup=False, soft_wrap=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _add_norms(opts: IndexCommand) -> None:
    """``--add-norms``: compute the row norms of the index saved in ``--out`` from STORE and save the index again
    with them (atomically: the FAISS data is written unchanged)."""
    from ..score.index import FaissMissing, Index, IndexMismatch
    from ..store import GradientStore

    if not (opts.out / "index.json").exists():
        raise CliError(f"--add-norms adds row norms to the index saved in --out; {opts.out} holds none: build one "
                       f"with gradtrace index {opts.store} --out {opts.out}")
    try:
        try:
            index = Index.load(opts.out)
        except IndexMismatch:  # a version-1 index whose norms file is missing or damaged: written again below
            index = Index.load(opts.out, row_norms=False)
    except FaissMissing as err:
        raise CliError(str(err)) from None
    store = GradientStore.open(opts.store)
    index.check_store(store)  # another store, or a changed one: refused before anything else
    out = console()
    if index.row_norms is not None:
        out.print(f"Index {opts.out} already records the norms of its {len(index):,} rows; nothing to do")
        return
    phases = Phases()
    with phases("row norms"):
        norms = index.attach_row_norms(store, block_rows=opts.build_options.block_rows,
                                       progress=opts.progress)
    out.print(f"Added the L2 norms of {len(norms):,} rows of {opts.store} to {opts.out} "
              f"({human_bytes(4 * len(norms))})")
    out.print(f"Next: gradtrace score {opts.store} QUERIES --index {opts.out} --norm-rows {max(1, len(norms) // 100)} "
              "--out SCORES_DIR")
    if opts.progress:
        console(stderr=True).print(phases.table())
