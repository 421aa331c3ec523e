"""LoGra: Kronecker-factored random projection of per-example gradients, applied at capture time.

For a matrix parameter with per-example gradient ``G = sum_t r_t c_t^T`` (rows x cols) the projected
gradient is ``P_r G P_c^T = sum_t (P_r r_t)(P_c c_t)^T`` -- a ``k_r x k_c`` matrix obtained from the
projected factors alone, never touching the full ``rows x cols`` gradient. Flattened row-major it
equals ``(P_r (x) P_c) vec(G)``. Vector parameters (biases, norm weights) get one dense matrix.

Matrices are Gaussian with variance ``1/k`` (so squared norms are preserved in expectation),
generated on the CPU from a stable hash of ``(seed, parameter name, axis, size, k)`` and then moved
to the device: the same spec gives the same numbers on every machine and device, and parameters
shared by several layers (tied embeddings) are projected consistently at all their use sites.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import Tensor

from .base import register_projection

__all__ = ["LoGra", "PCABasis", "Projector", "check_projection_size", "gaussian_matrix", "per_layer", "register_pca",
           "stable_seed"]

_SCHEME = "gradtrace/logra/v1"


class PCABasis(Protocol):
    """The directions ``LoGra(init="pca")`` projects onto, built from a fitted K-FAC curvature by
    :func:`gradtrace.fit.curvature.pca.pca_basis` (this package sits below the curvature and never imports it)."""

    fingerprint: str  # a hash of the eigendata: stores projected with different bases are refused

    def directions(self, param: str, axis: str, n: int, k: int) -> Tensor:
        """``[k, n]``: the top-``k`` directions (rows) of axis ``axis`` of parameter ``param`` (``n`` wide)."""
        ...


_PCA: dict[str, Callable[..., Any]] = {}


def register_pca(*, fit: Callable[..., LoGra], basis: Callable[[Any], PCABasis]) -> None:
    """Plug in how :meth:`LoGra.pca` fits a basis (``fit``) and how ``LoGra(init="pca", basis=...)`` turns a
    fitted curvature or its directory into a :class:`PCABasis` (``basis``); :mod:`gradtrace.fit.curvature.pca` does
    this when gradtrace is imported."""
    _PCA.update(fit=fit, basis=basis)


def _pca(name: str) -> Callable[..., Any]:
    if name not in _PCA:
        raise RuntimeError("PCA-initialised LoGra needs gradtrace.fit.curvature: import it first (gradtrace.LoGra, "
                           "the top-level name, does)")
    return _PCA[name]


def per_layer(projection: Any, what: str) -> LoGra | None:
    """``projection`` (``CaptureOptions.projection``) when ``what`` can apply it: a :class:`LoGra` spec or None.

    Raises ValueError for a whole-gradient sketch (``DenseProjection``/``SparseProjection``), which only the LESS
    features apply (to the exact gradients they form), naming the two ways out.
    """
    if projection is None or isinstance(projection, LoGra):
        return projection
    raise ValueError(f"{what} projects each layer's gradient with gradtrace.LoGra(...), but CaptureOptions.projection "
                     f"is a {type(projection).__name__}, a sketch of the whole gradient: pass LoGra(rank=...) "
                     "(or None for exact gradients), or use the sketch with gradtrace.less_features / "
                     "less_query_features, which apply it")


@register_projection("logra")
@dataclass(frozen=True)
class LoGra:
    """LoGra projection spec.

    rank: projected size of each factor of a matrix parameter (so ``rank**2`` per matrix) and of
        vector parameters; ``rank_rows`` / ``rank_cols`` / ``vector_rank`` override it per axis.
    ranks: per-parameter ranks of matrix parameters, ``{name glob: rank | (rows, cols)}`` (the first matching
        glob wins; e.g. ``{"*wte.weight": (512, 32)}`` keeps a 512-token vocabulary axis whole). Every glob must
        match a captured parameter. Vector parameters keep ``vector_rank``.
    seed: projection seed; stores and queries must use the same seed to be comparable.
    keep_tokens: keep the per-token projected factors (needed for token-level attribution)
        instead of summing each example over its tokens right away.
    init: ``"random"`` (Gaussian) or ``"pca"``: project onto the top eigenvectors of K-FAC factors
        (``basis``: a :class:`gradtrace.fit.curvature.Curvature` fitted on exact gradients without joined biases,
        or its directory; see :meth:`pca`). In that basis K-FAC is diagonal, so the projection keeps the
        top Kronecker eigen-directions.
    """

    rank: int = 16
    seed: int = 0
    rank_rows: int | None = None
    rank_cols: int | None = None
    vector_rank: int | None = None
    keep_tokens: bool = False
    init: str = "random"
    basis: Any = field(default=None, compare=False, repr=False)
    ranks: Any = ()

    def __post_init__(self) -> None:
        for name in ("rank", "rank_rows", "rank_cols", "vector_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"LoGra.{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "ranks", _normalize_ranks(self.ranks))
        if self.init not in ("random", "pca"):
            raise ValueError(f"LoGra.init must be 'random' or 'pca', got {self.init!r}")
        if self.init == "pca":
            if self.basis is None:
                raise ValueError("LoGra(init='pca') needs basis= (a fitted K-FAC curvature): see LoGra.pca(...)")
            object.__setattr__(self, "basis", _pca("basis")(self.basis))

    @classmethod
    def pca(cls, model: Any, data: Any, loss_fn: Any = None, *, rank: int = 16, fisher: str = "empirical",
            layers: Any = None, exclude: Any = None, ranks: Any = (), **options: Any) -> LoGra:
        """Fit K-FAC factors on exact gradients of ``data`` and return a PCA-initialised LoGra spec
        (:func:`gradtrace.fit.curvature.pca.pca_logra`)."""
        return _pca("fit")(model, data, loss_fn, rank=rank, fisher=fisher, layers=layers, exclude=exclude,
                           ranks=ranks, **options)

    def k_for(self, param: str, axis: str) -> int:
        """Projected size of axis ``axis`` (``"rows"``, ``"cols"``, ``"vector"``) of parameter ``param``."""
        if axis != "vector":
            for pattern, rows, cols in self.ranks:
                if fnmatchcase(param, pattern):
                    return rows if axis == "rows" else cols
        return {"rows": self.k_rows, "cols": self.k_cols, "vector": self.k_vector}[axis]

    @property
    def k_rows(self) -> int:
        return self.rank_rows or self.rank

    @property
    def k_cols(self) -> int:
        return self.rank_cols or self.rank

    @property
    def k_vector(self) -> int:
        return self.vector_rank or self.rank

    @cached_property
    def projector(self) -> Projector:
        """The matrices of this spec, generated once and cached per device."""
        return Projector(self)

    def project(self, grads: Tensor, key: str = "") -> Tensor:
        """Per-example gradients ``[E, *shape]`` of parameter ``key`` projected as capture projects them:
        ``[E, k]`` float32 (see :meth:`Projector.project_full`)."""
        return self.projector.project_full(key, grads, tuple(grads.shape[1:]))

    @classmethod
    def from_dict(cls, spec: dict) -> LoGra:
        """Rebuild a spec from :meth:`to_dict` (e.g. a store's manifest), refusing other schemes."""
        if spec.get("kind") != "logra" or spec.get("scheme") != _SCHEME:
            raise ValueError(f"not a LoGra spec of this gradtrace version: {spec}")
        return cls(rank=spec["rank_rows"], rank_cols=spec["rank_cols"], vector_rank=spec["vector_rank"],
                   seed=spec["seed"], ranks=tuple(tuple(r) for r in spec.get("ranks", ())))

    def to_dict(self) -> dict:
        """The spec as stored in manifests: everything that determines the projected numbers."""
        out = {"kind": "logra", "scheme": _SCHEME, "distribution": "gaussian", "seed": self.seed,
               "rank_rows": self.k_rows, "rank_cols": self.k_cols, "vector_rank": self.k_vector}
        if self.ranks:  # absent when unused, so specs without overrides stay as they were
            out["ranks"] = [list(r) for r in self.ranks]
        if self.init == "pca":
            out.update(distribution="pca", init="pca", basis=self.basis.fingerprint)
        return out


def _normalize_ranks(ranks: Any) -> tuple[tuple[str, int, int], ...]:
    """``{glob: rank | (rows, cols)}`` or ``[(glob, rows, cols), ...]`` -> a tuple of ``(glob, rows, cols)``."""
    items = ranks.items() if isinstance(ranks, dict) else [(r[0], tuple(r[1:])) for r in (ranks or ())]
    out = []
    for pattern, value in items:
        pair = (value, value) if isinstance(value, int) else tuple(value)
        if len(pair) == 1:
            pair = (pair[0], pair[0])
        if not isinstance(pattern, str) or len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
            raise ValueError(f"LoGra.ranks entries are {{name glob: rank or (rows, cols)}} with positive integer "
                             f"ranks, got {pattern!r}: {value!r}")
        out.append((pattern, int(pair[0]), int(pair[1])))
    return tuple(out)


def unmatched_ranks(spec: LoGra, names: Any) -> list[str]:
    """The globs of ``spec.ranks`` that match none of the parameter ``names``."""
    names = list(names)
    return [pattern for pattern, _, _ in spec.ranks if not any(fnmatchcase(n, pattern) for n in names)]


def check_projection_size(spec: LoGra, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse ranks larger than every dimension of the parameters to project, before anything is allocated.

    shapes: ``{parameter name: shape}`` of the parameters to project. Projecting an axis of ``n`` numbers to
    ``k > n`` adds numbers but no information; a rank above every captured dimension is a mistake (a typo such
    as ``--rank 100000`` asks for ``1e10`` floats per matrix parameter and example), refused with the memory it
    would take.
    """
    projected, largest, biggest_k = 0, 1, 0
    for name, shape in shapes.items():
        if len(shape) >= 2:
            k_rows, k_cols = spec.k_for(name, "rows"), spec.k_for(name, "cols")
            projected += k_rows * k_cols
            largest = max(largest, shape[0], math.prod(shape[1:]))
            biggest_k = max(biggest_k, k_rows, k_cols)
        else:
            projected += spec.k_for(name, "vector")
            largest = max(largest, math.prod(shape))
            biggest_k = max(biggest_k, spec.k_for(name, "vector"))
    if biggest_k <= largest:
        return
    raise ValueError(
        f"LoGra rank {biggest_k} is larger than every dimension of the {len(shapes)} captured parameters (the "
        f"largest is {largest}): it adds numbers, not information, and each example's projected gradient would "
        f"take {projected:,} floats ({projected * 4 / 2**30:,.1f} GiB). Use a rank of at most {largest} "
        "(16-128 is typical)")


def stable_seed(*parts: object) -> int:
    """A 63-bit integer derived from ``parts`` by a cryptographic hash (stable across runs)."""
    digest = hashlib.blake2b("|".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


UPCAST_BLOCK = 1 << 22
"""Values of a bf16/fp16 input upcast to float32 at a time by :meth:`Projector.project` (16 MiB of float32)."""


def gaussian_matrix(k: int, n: int, seed: int) -> Tensor:
    """A ``[k, n]`` float32 CPU matrix with i.i.d. ``N(0, 1/k)`` entries from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(k, n, generator=gen, dtype=torch.float32).div_(math.sqrt(k))


class Projector:
    """Hands out (and caches per device) the projection matrices of a :class:`LoGra` spec.

    grad_dtype: the dtype of :meth:`project`'s products for bf16/fp16 inputs (``CaptureOptions.grad_dtype``):
    ``"float32"`` (upcast by blocks) or ``"activation"`` (the input's own dtype, the result returned in float32).
    """

    def __init__(self, spec: LoGra, grad_dtype: str = "float32") -> None:
        if grad_dtype not in ("float32", "activation"):
            raise ValueError(f"grad_dtype must be 'float32' or 'activation', got {grad_dtype!r}")
        self.spec = spec
        self.grad_dtype = grad_dtype
        self._cache: dict[tuple, Tensor] = {}

    def k(self, param: str, axis: str) -> int:
        return self.spec.k_for(param, axis)

    def matrix(self, param: str, axis: str, n: int, device: torch.device | str = "cpu") -> Tensor:
        """The ``[k, n]`` matrix projecting axis ``axis`` ("rows", "cols" or "vector") of ``param``."""
        device = torch.device(device)
        key = (param, axis, n, device)
        mat = self._cache.get(key)
        if mat is None:
            k = self.k(param, axis)
            if self.spec.init == "pca":
                mat = self.spec.basis.directions(param, axis, n, k).to(device)
            else:
                mat = gaussian_matrix(k, n, stable_seed(_SCHEME, self.spec.seed, param, axis, n, k)).to(device)
            self._cache[key] = mat
        return mat

    def project(self, param: str, axis: str, x: Tensor) -> Tensor:
        """Project the last dimension of ``x`` (``[..., n]``) to ``[..., k]`` in float32.

        The product is computed in float32 (a bf16/fp16 product would round each projected value to 8 or 11
        significant bits; the accumulation over ``n`` terms needs float32). A bf16/fp16 ``x`` is upcast by blocks of
        rows (:data:`UPCAST_BLOCK` values each), never whole: for an LM head's output gradient (``[tokens, V]``)
        that is one block of float32 instead of a float32 copy of the whole ``[tokens, V]``.

        With ``grad_dtype="activation"`` a bf16/fp16 ``x`` is projected in its own dtype against the matrix rounded
        to it (cached), and the ``[..., k]`` result converted to float32: no upcast, one rounding of each projected
        value to the input's precision.
        """
        mat = self.matrix(param, axis, x.shape[-1], x.device)
        if x.dtype == torch.float32:
            return torch.matmul(x, mat.t())
        if self.grad_dtype == "activation" and x.dtype in (torch.bfloat16, torch.float16):
            key = (param, axis, x.shape[-1], x.device, x.dtype)
            low = self._cache.get(key)
            if low is None:
                low = self._cache[key] = mat.to(x.dtype)
            return torch.matmul(x, low.t()).to(torch.float32)
        n = x.shape[-1]
        flat = x.reshape(-1, n)
        rows = max(1, UPCAST_BLOCK // max(n, 1))
        if flat.shape[0] <= rows:
            return torch.matmul(x.to(torch.float32), mat.t())
        out = torch.empty(flat.shape[0], mat.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, flat.shape[0], rows):  # blocks of rows, not a loop over tokens
            torch.matmul(flat[start:start + rows].to(torch.float32), mat.t(), out=out[start:start + rows])
        return out.reshape(*x.shape[:-1], mat.shape[0])

    def project_full(self, param: str, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Project full gradients ``[N, *shape]`` of ``param`` the way capture does: ``[N, k]``.

        Matrix parameters (``len(shape) >= 2``) are viewed as ``[shape[0], prod(shape[1:])]`` and
        projected to ``P_rows G P_cols^T`` (flattened row-major); vectors to ``P g``.
        """
        grads = grads.to(torch.float32)
        count = grads.shape[0]
        if len(shape) == 1:
            return grads @ self.matrix(param, "vector", shape[0], grads.device).t()
        matrices = grads.reshape(count, shape[0], -1)
        rows = self.matrix(param, "rows", matrices.shape[1], grads.device)
        cols = self.matrix(param, "cols", matrices.shape[2], grads.device)
        return torch.matmul(torch.matmul(rows, matrices), cols.t()).reshape(count, -1)

    def project_index(self, param: str, axis: str, n: int, ids: Tensor) -> Tensor:
        """Project one-hot vectors given by ``ids`` (``[...]``, ``-1`` = zero vector) to ``[..., k]``."""
        mat = self.matrix(param, axis, n, ids.device)
        out = mat.t().index_select(0, ids.clamp(min=0).reshape(-1)).reshape(*ids.shape, -1)
        return out * (ids >= 0).unsqueeze(-1).to(out.dtype)
