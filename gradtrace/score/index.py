"""An approximate nearest-neighbour index over a gradient store (FAISS), for shortlisting large stores.

``build_index(store, IndexOptions(kind="ivfpq"))`` streams the store's rows into a FAISS inner-product index and
``Index.search(query_vectors, r)`` returns the ``r`` rows of highest approximate inner product with each
query. The index only *shortlists*: :func:`gradtrace.score.shortlist.score_with_index` re-scores the
shortlist exactly from the store, so every reported score is exact and only recall is approximate.

Kinds:

* ``"flat"`` -- exact inner product over float32 copies of all rows (``rows * dim * 4`` bytes in memory
  and on disk): the reference, for stores that fit in memory;
* ``"ivfpq"`` -- an inverted file of ``nlist`` k-means cells with product-quantized rows (``m``
  sub-quantizers of ``nbits`` bits: ``m * nbits / 8`` bytes per row). The quantizers are trained on a
  uniform sample of ``train_rows`` rows; rows are then added block by block, so the store is never in
  memory whole. ``nprobe`` cells are visited per query (``min(nlist, 16)``, saved with the index, unless the
  search says otherwise: :class:`gradtrace.options.index.SearchOptions`).
  With ``fast_scan=True`` the codes are 4 bits and laid out for FAISS's SIMD "fast scan" (``PQ{m}x4fs``):
  the same bytes per row with twice the sub-quantizers, several times faster to search and to build, at
  a coarser approximate score (which the exact re-scoring of the shortlist absorbs for the top-k).

One index serves every method whose training side is the raw stored row (``grad_dot``, ``kfac``, ``ekfac``,
``ggn``, ``logra``: influence methods precondition the *query* only), searched with the prepared query.
``grad_cos`` needs an index of normalized rows (``normalize=True``). The index records the store's
fingerprint (:func:`store_fingerprint`) and refuses a store that changed or another store.

The index also keeps every row's L2 norm (``Index.row_norms``, ``row_norms.npy``: 4 bytes per row, computed in
the pass that adds the rows; :meth:`Index.attach_row_norms` adds them to an index built before they were
recorded): ``score_with_index(..., SearchOptions(norm_rows=N))`` scores the ``N`` rows of largest norm for every query
(:mod:`gradtrace.score.row_norms` says why).

FAISS is an optional dependency: ``pip install 'gradtrace[index]'``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..options.base import option_object
from ..options.index import IndexOptions
from ..store.artifact import (
    ArtifactError,
    ArtifactExists,
    UncheckedArtifactWarning,
    artifact_file,
    artifact_kind,
    read_artifact,
    refuse_inside_artifact,
    write_artifact,
)
from ..store.fingerprint import fingerprint_difference, store_fingerprint
from ..store.layout import StoreError
from .index_training import auto_kind, faiss_warnings_once
from .row_norms import NORMS_FILE, block_norms, read_row_norms, store_row_norms

__all__ = [
    "INDEX_FORMAT",
    "KINDS",
    "FaissMissing",
    "Index",
    "IndexMismatch",
    "IndexParams",
    "build_index",
    "store_fingerprint",
]

INDEX_FORMAT = "gradtrace-index"
INDEX_VERSION = 2
"""2: one checksummed artifact (manifest, FAISS data and row norms under content-addressed names)."""
_LEGACY_VERSION = 1
"""Indexes saved before checksums: ``index.json``, ``index.faiss`` and ``row_norms.npy`` (loaded with a warning)."""
KINDS = ("flat", "ivfpq")
_STEM = "index"
_META = "index.json"
_DATA = "index.faiss"
"""The FAISS file of a version-1 index."""


def _faiss_layout(faiss_index: Any) -> dict[str, Any]:
    """What a FAISS index is: ``{"kind", "metric"}``, and for IVF-PQ ``nlist``, ``m``, ``nbits``, ``fast_scan``."""
    faiss = _faiss()
    layout: dict[str, Any] = {"metric": int(faiss_index.metric_type)}
    if isinstance(faiss_index, faiss.IndexFlat):
        return {"kind": "flat", **layout}
    try:
        ivf = faiss.extract_index_ivf(faiss_index)
    except RuntimeError:
        return {"kind": type(faiss_index).__name__, **layout}
    ivf = faiss.downcast_index(ivf)
    pq = getattr(ivf, "pq", None)
    if pq is None:
        return {"kind": type(ivf).__name__, **layout}
    return {"kind": "ivfpq", **layout, "nlist": int(ivf.nlist), "m": int(pq.M), "nbits": int(pq.nbits),
            "fast_scan": isinstance(ivf, faiss.IndexIVFPQFastScan)}


class IndexMismatch(StoreError):
    """An index does not belong to (this version of) the store it is used with, is corrupted, or cannot serve
    the requested method."""


class FaissMissing(ImportError):
    """FAISS is not installed (the ``[index]`` extra)."""


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise FaissMissing("gradient indexes need FAISS, which is not installed: pip install 'gradtrace[index]' "
                           "(or pip install faiss-cpu)") from None
    return faiss


# -- parameters ------------------------------------------------------------------------------------
@dataclass
class IndexParams:
    """What an index is, as built and saved (``index.json``'s ``params``): the :class:`IndexOptions` it was built
    with, defaults filled in for its store (:meth:`resolve`), and ``nprobe``, the IVF cells a search visits unless
    told otherwise (``min(nlist, 16)``; None for a flat index).

    kind: ``"flat"`` or ``"ivfpq"``. normalize: unit-norm rows (for ``grad_cos``). nlist, m, nbits: the IVF cells
    and PQ codes (None for a flat index). train_rows, seed: the quantizers' training sample. fast_scan: 4-bit codes
    laid out for FAISS's fast-scan kernels (``PQ{m}x4fs``).
    """

    kind: str = "flat"
    normalize: bool = False
    nlist: int | None = None
    m: int | None = None
    nbits: int | None = None
    nprobe: int | None = None
    train_rows: int = 65536
    seed: int = 0
    fast_scan: bool = False

    @classmethod
    def resolve(cls, options: IndexOptions, rows: int, dim: int) -> IndexParams:
        """The parameters of an index built with ``options`` (``kind`` "flat" or "ivfpq", not "auto") over a
        store of ``rows x dim``; settings the store cannot serve are a ValueError."""
        if options.kind not in KINDS:
            raise ValueError(f"an index's kind is one of {KINDS}, not {options.kind!r}: build_index resolves "
                             "kind='auto' first")
        if options.kind == "flat":
            return cls("flat", options.normalize, None, None, None, None, options.train_rows, options.seed)
        nbits = options.nbits or (4 if options.fast_scan else 8)
        train_rows = min(options.train_rows, rows)
        nlist = options.nlist or max(1, min(round(math.sqrt(rows)), train_rows // 39))
        per_code = 8 if options.fast_scan else 16  # dims per sub-quantizer: 1 byte per 16 dims either way
        m = options.m or max(d for d in range(1, max(1, dim // per_code) + 1) if dim % d == 0)
        if dim % m:
            raise ValueError(f"PQ sub-quantizers m={m} must divide the store's dimension {dim}")
        need = max(nlist, 2**nbits)
        if train_rows < need:
            raise ValueError(f"an ivfpq index with nlist={nlist} and nbits={nbits} needs at least {need} training "
                             f"rows; the store has {rows} and train_rows={options.train_rows}: lower nlist/nbits or "
                             "use kind='flat'")
        return cls("ivfpq", options.normalize, nlist, m, nbits, min(nlist, 16), train_rows, options.seed,
                   options.fast_scan)

    def factory(self) -> str:
        """The FAISS ``index_factory`` string."""
        if self.kind == "flat":
            return "Flat"
        return f"IVF{self.nlist},PQ{self.m}x{self.nbits}{'fs' if self.fast_scan else ''}"


# -- the index -------------------------------------------------------------------------------------
class Index:
    """A FAISS inner-product index over the rows of one gradient store.

    Row ``j`` of the index is row ``j`` of the store (the store's global numbering). Attributes:
    ``params`` (:class:`IndexParams`), ``fingerprint`` (of the store it was built from), ``meta`` (store
    path, build time, ...), ``path`` (where it was saved or loaded from, else None), ``row_norms`` (float32
    ``[rows]`` L2 norms of the raw stored rows, or None for an index saved before they were recorded).
    """

    def __init__(self, faiss_index: Any, params: IndexParams, fingerprint: dict[str, Any],
                 meta: dict[str, Any] | None = None, path: Path | None = None,
                 row_norms: Tensor | None = None) -> None:
        self.faiss_index = faiss_index
        self.params = params
        self.fingerprint = fingerprint
        self.meta = dict(meta or {})
        self.path = path
        if row_norms is not None and len(row_norms) != len(self):
            raise ValueError(f"row_norms has {len(row_norms)} entries for an index of {len(self)} rows")
        self.row_norms = row_norms

    def __len__(self) -> int:
        return int(self.faiss_index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.faiss_index.d)

    @property
    def normalized(self) -> bool:
        return self.params.normalize

    def check_store(self, store: Any) -> None:
        """Raise :class:`IndexMismatch` unless ``store`` holds exactly the rows this index was built from."""
        current = store_fingerprint(store)
        if current["digest"] == self.fingerprint.get("digest"):
            return
        built_from = self.meta.get("store", "?")
        where = f"index {self.path}" if self.path else "this index"
        same_place = str(Path(str(store.root)).resolve()) == built_from
        what = (f"store {store.root} changed since {where} was built" if same_place
                else f"{where} was built from another store ({built_from}), not {store.root}")
        raise IndexMismatch(f"{what}: {fingerprint_difference(self.fingerprint, current)}. Rebuild it: "
                            f"gradtrace index {store.root} --out INDEX")

    def attach_row_norms(self, store: Any, *, block_rows: int = 65536, progress: bool = False) -> Tensor:
        """Compute every row's L2 norm from ``store`` (one streaming pass) for an index built without them.

        The store is checked first (:meth:`check_store`: an index of another store, or of a store that changed,
        is refused before anything is read). An index that was saved or loaded (``path`` set) gets the norms
        written there: ``row_norms.npy``, then ``index.json`` updated, each atomically (``index.faiss`` is not
        rewritten). Returns the norms (also ``self.row_norms``).
        """
        self.check_store(store)
        norms = store_row_norms(store, block_rows, progress)
        self.row_norms = norms
        if self.path is not None:
            self.save(self.path, overwrite=True)
        return norms

    def search(self, query_vectors: Tensor, r: int, *, nprobe: int | None = None) -> tuple[Tensor, Tensor]:
        """The ``r`` rows of highest approximate inner product with each query.

        Args:
            query_vectors: ``[Q, dim]`` float vectors, as they are (an index of normalized rows does not
                normalize queries: pass prepared queries; for ``grad_cos`` they are unit-norm already).
            r: candidates per query (at most the number of rows).
            nprobe: IVF cells to visit (default: the one saved with the index).
        Returns:
            ``(approx_scores [Q, r] float32, rows [Q, r] int64)`` in decreasing approximate score; ``rows`` is
            ``-1`` where an IVF search found fewer than ``r`` rows in the cells it visited.
        """
        if query_vectors.dim() != 2 or query_vectors.shape[1] != self.dim:
            raise ValueError(f"expected [Q, {self.dim}] query vectors, got {tuple(query_vectors.shape)}")
        if r < 1:
            raise ValueError(f"r must be positive, got {r}")
        queries = query_vectors.detach().to("cpu", torch.float32).contiguous()
        finite = torch.isfinite(queries).all(dim=1)
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten().tolist()
            raise ValueError(f"query vector(s) {bad[:5]} hold NaN/inf values; an index cannot rank them")
        self._set_nprobe(nprobe or self.params.nprobe)
        try:
            values, rows = self.faiss_index.search(queries.numpy(), min(r, len(self)))
        finally:  # the FAISS object keeps the saved setting: a later save writes the index as it was built
            self._set_nprobe(self.params.nprobe)
        return torch.from_numpy(values), torch.from_numpy(rows.astype(np.int64, copy=False))

    def _set_nprobe(self, nprobe: int | None) -> None:
        if self.params.kind == "ivfpq" and nprobe:
            _faiss().extract_index_ivf(self.faiss_index).nprobe = int(min(nprobe, self.params.nlist or nprobe))

    def nbytes(self) -> int:
        """Size of the saved FAISS data."""
        return len(_faiss().serialize_index(self.faiss_index))

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Save the index in directory ``path`` as one artifact (:func:`gradtrace.store.artifact.write_artifact`):
        ``index.json`` (parameters, the store's fingerprint, and the size and checksum of every file),
        ``index-faiss-<hash>.faiss`` (the FAISS data) and ``index-<hash>.safetensors`` (the row norms, when the
        index has them). Every file is written under a temporary name and the manifest is replaced last, in one
        rename, under the directory's write lock: a save that fails or is killed at any point leaves the previous
        index whole, and it loads and searches as before. An existing index is replaced only with ``overwrite``;
        a directory that is a gradient store or another artifact, or lies inside one, is refused."""
        faiss = _faiss()
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise IndexMismatch(f"{path} exists and is not a directory")
        kind = artifact_kind(path) if path.is_dir() else None
        if kind == "a gradient store":
            raise IndexMismatch(f"{path} is a gradient store; save the index in another directory")
        if kind not in (None, "an index"):
            raise IndexMismatch(f"{path} holds {kind}; save the index in another directory")
        try:
            refuse_inside_artifact(path, "the index directory")
        except ArtifactError as err:
            raise IndexMismatch(str(err)) from None
        info = {"kind": self.params.kind, "params": asdict(self.params), "rows": len(self), "dim": self.dim,
                "metric": "inner_product", "fingerprint": self.fingerprint, "meta": self.meta}
        tensors = {} if self.row_norms is None else {"row_norms": self.row_norms.detach().to("cpu", torch.float32)}
        files = {"faiss": (".faiss", lambda tmp: faiss.write_index(self.faiss_index, str(tmp)))}
        try:
            write_artifact(path, _STEM, INDEX_FORMAT, INDEX_VERSION, info, tensors, files=files, overwrite=overwrite,
                           what="an index", legacy_files=(_DATA, NORMS_FILE))
        except ArtifactExists:
            raise IndexMismatch(f"{path} already holds an index: pass overwrite=True (--overwrite) to replace "
                                "it") from None
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path, *, row_norms: bool = True) -> Index:
        """Open an index saved by :meth:`save`, verified: the manifest's checksum, the size and checksum of the
        FAISS data and of the row norms, and that the FAISS data is an index of the recorded kind, parameters,
        rows and dimension (:class:`IndexMismatch` naming the file otherwise). An index saved by gradtrace before
        checksums (version 1: ``index.faiss`` beside ``index.json``) loads with an ``UncheckedArtifactWarning``:
        only its kind, shape and row norms can be checked. ``row_norms=False`` leaves the saved norms unused
        (``row_norms=None``)."""
        path = Path(path)
        meta_path = path / _META
        if not meta_path.is_file():
            raise IndexMismatch(f"{path} holds no gradtrace index ({_META} missing): build one with gradtrace index "
                                "STORE --out INDEX")
        rebuild = f"rebuild it: gradtrace index STORE --out {path} --overwrite"
        try:
            head = json.loads(meta_path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise IndexMismatch(f"{meta_path} is corrupted ({err}); {rebuild}") from None
        version = head.get("version") if isinstance(head, dict) else None
        if isinstance(head, dict) and head.get("format") == INDEX_FORMAT and version == _LEGACY_VERSION:
            return cls._load_v1(path, head, row_norms)
        try:
            info, tensors = read_artifact(path, _STEM, INDEX_FORMAT, INDEX_VERSION, what="index",
                                          error=IndexMismatch)
        except IndexMismatch as err:
            raise IndexMismatch(str(err).replace("the index must be saved again", rebuild)) from None
        try:
            params = IndexParams(**info["params"])
            fingerprint = dict(info["fingerprint"])
        except (KeyError, TypeError, ValueError) as err:
            raise IndexMismatch(f"{meta_path} is malformed ({err!r}); {rebuild}") from None
        data = artifact_file(path, info, "faiss")
        index = cls(cls._read_faiss(data, path, info, params, fingerprint), params, fingerprint, info.get("meta"),
                    path)
        norms = tensors.get("row_norms")
        if norms is not None and (norms.dtype != torch.float32 or tuple(norms.shape) != (len(index),)):
            raise IndexMismatch(f"index {path}: its row norms are {norms.dtype} {tuple(norms.shape)}, not float32 "
                                f"({len(index)},); {rebuild}")
        index.row_norms = norms if row_norms else None
        return index

    @classmethod
    def _read_faiss(cls, data: Path, path: Path, info: dict[str, Any], params: IndexParams,
                    fingerprint: dict[str, Any]) -> Any:
        """Read FAISS data and check that it is the index ``info`` describes: kind and parameters, metric, rows and
        dimension (those of the store's fingerprint too)."""
        faiss = _faiss()
        rebuild = f"rebuild it: gradtrace index STORE --out {path} --overwrite"
        if not data.is_file():
            raise IndexMismatch(f"index {path}: {data.name} is missing; {rebuild}")
        try:
            faiss_index = faiss.read_index(str(data))
        except RuntimeError as err:
            raise IndexMismatch(f"index {path}: {data.name} is damaged ({str(err).splitlines()[0]}); "
                                f"{rebuild}") from None
        if faiss_index.ntotal != info.get("rows") or faiss_index.d != info.get("dim") \
                or faiss_index.ntotal != fingerprint.get("rows"):
            raise IndexMismatch(f"index {path}: {data.name} holds {faiss_index.ntotal} x {faiss_index.d} rows, "
                                f"{_META} says {info.get('rows')} x {info.get('dim')}; {rebuild}")
        found = _faiss_layout(faiss_index)
        expected = {"kind": params.kind, "metric": faiss.METRIC_INNER_PRODUCT}
        if params.kind == "ivfpq":
            expected.update(nlist=params.nlist, m=params.m, nbits=params.nbits, fast_scan=params.fast_scan)
        if found != expected:
            raise IndexMismatch(f"index {path}: {data.name} is not the index {_META} describes (it is {found}, the "
                                f"manifest records {expected}); {rebuild}")
        return faiss_index

    @classmethod
    def _load_v1(cls, path: Path, info: dict[str, Any], row_norms: bool) -> Index:
        """An index of version 1 (no checksums): kind, shape and row norms checked, with a warning."""
        try:
            params = IndexParams(**info["params"])
            fingerprint = dict(info["fingerprint"])
        except (KeyError, TypeError, ValueError) as err:
            raise IndexMismatch(f"{path / _META} is corrupted: {err!r}") from None
        warnings.warn(f"index {path} was saved by an older gradtrace (version {_LEGACY_VERSION}) without checksums: "
                      f"a damaged or replaced {_DATA} cannot be detected; rebuild it (gradtrace index STORE --out "
                      f"{path} --overwrite) to add them", UncheckedArtifactWarning, stacklevel=3)
        faiss_index = cls._read_faiss(path / _DATA, path, info, params, fingerprint)
        index = cls(faiss_index, params, fingerprint, info.get("meta"), path)
        record = info.get("row_norms")
        if row_norms and record is not None:
            try:
                index.row_norms = read_row_norms(path, record, len(index), str(index.meta.get("store", "STORE")))
            except StoreError as err:
                raise IndexMismatch(str(err)) from None
        return index

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path else ""
        return (f"Index(kind={self.params.kind!r}, rows={len(self)}, dim={self.dim}, "
                f"normalize={self.params.normalize}{where})")


# -- building --------------------------------------------------------------------------------------
def _checked(block: Tensor, rows: int | np.ndarray, store: Any, normalize: bool) -> np.ndarray:
    """A ``[n, dim]`` block as contiguous float32 numpy, normalized if asked; NaN/inf rows are refused.
    ``rows``: the store row of the block's first row (a contiguous block), or of each of its rows."""
    finite = torch.isfinite(block).all(dim=1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0])
        row = rows + first if isinstance(rows, int) else int(rows[first])
        raise IndexMismatch(f"store {store.root}: row {row} (id {store.ids[row]!r}) holds NaN/inf values; an index "
                            "cannot hold it. Recollect that example or rebuild the store without it")
    if normalize:
        block = block / block.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return np.ascontiguousarray(block.numpy(), dtype=np.float32)


def _training_sample(store: Any, params: IndexParams, block_rows: int) -> np.ndarray:
    """``train_rows`` rows drawn uniformly without replacement (seeded), read in store order."""
    rows = len(store)
    gen = torch.Generator().manual_seed(params.seed)
    picked = torch.randperm(rows, generator=gen)[:params.train_rows].sort().values.numpy()
    parts = [_checked(store.rows(picked[i:i + block_rows]), picked[i:i + block_rows], store, params.normalize)
             for i in range(0, len(picked), block_rows)]
    return np.concatenate(parts)


def build_index(store: Any, options: IndexOptions | None = None, *, block_rows: int = 65536,
                progress: bool = False) -> Index:
    """Build an inner-product index over every row of a gradient store, streaming it in blocks.

    Args:
        store: a :class:`gradtrace.GradientStore` (or its path).
        options: what index is built (:class:`gradtrace.options.index.IndexOptions`; default: a flat index of raw
            rows). ``kind="auto"`` picks flat below 10,000 rows (:func:`gradtrace.score.index_training.auto_kind`;
            the reason is recorded as ``meta["auto_kind"]``).
        block_rows: rows read and added per block (bounds memory while adding); the same pass records every
            row's L2 norm (``Index.row_norms``, of the raw rows also when ``options.normalize``).
        progress: show a progress bar over blocks.
    Returns:
        The :class:`Index` (not saved: :meth:`Index.save`); ``params`` records what was built, and the IVF cells
        a search visits by default (``nprobe``: ``min(nlist, 16)``; :class:`gradtrace.options.index.SearchOptions`
        chooses per search).
    Raises:
        TypeError: ``store`` is not a gradient store, or ``options`` not an ``IndexOptions``.
        IndexMismatch: the store is empty, or one of its rows holds NaN/inf.
        ValueError: settings the store cannot serve (``m`` not dividing its dimension, too few training rows).
        FaissMissing: FAISS is not installed.
    """
    from ..store import GradientStore

    options = option_object(options, IndexOptions, "options")
    faiss = _faiss()
    if isinstance(store, (str, Path)):
        store = GradientStore.open(store)
    if not isinstance(store, GradientStore):
        raise TypeError(f"build_index needs a GradientStore (or its path), got {type(store).__name__}")
    if len(store) == 0:
        raise IndexMismatch(f"store {store.root} is empty: nothing to index")
    if block_rows < 1:
        raise ValueError("block_rows must be positive")
    why = None
    if options.kind == "auto":
        kind, why = auto_kind(len(store), options.nlist, options.m, options.nbits, options.fast_scan or None)
        options = replace(options, kind=kind)
    params = IndexParams.resolve(options, len(store), store.dim)
    fingerprint = store_fingerprint(store)
    start = time.perf_counter()
    faiss_index = faiss.index_factory(store.dim, params.factory(), faiss.METRIC_INNER_PRODUCT)
    if isinstance(faiss_index, faiss.IndexIVFPQ):  # the factory turns on polysemous training (annealing of the
        faiss_index.do_polysemous_training = False  # code order of every sub-quantizer): minutes at m=256, and only
        # the Hamming-filtered search, which this index never does, uses it
    timings: dict[str, float] = {}
    if not faiss_index.is_trained:
        sample = _training_sample(store, params, block_rows)
        with faiss_warnings_once(f"the {params.factory()} index on {len(sample):,} rows"):  # one warning, not one
            faiss_index.train(sample)  # per sub-quantizer
        del sample
        timings["train_s"] = time.perf_counter() - start
    blocks = store.iter_blocks(block_rows)
    if progress:
        from ..common.progress import progress_bar

        blocks = progress_bar(blocks, total=math.ceil(len(store) / block_rows), desc="index", unit="block")
    added = time.perf_counter()
    norms = torch.empty(len(store), dtype=torch.float32)
    for offset, block in blocks:
        norms[offset:offset + len(block)] = block_norms(block)  # of the raw rows, before any normalization
        faiss_index.add(_checked(block, offset, store, params.normalize))
    timings["add_s"] = time.perf_counter() - added
    from ..version import __version__

    meta = {"store": str(Path(str(store.root)).resolve()), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_s": time.perf_counter() - start, **timings, "gradtrace": __version__,
            "factory": params.factory(), **({"auto_kind": why} if why else {})}
    index = Index(faiss_index, params, fingerprint, meta, row_norms=norms)
    index._set_nprobe(params.nprobe)
    return index
