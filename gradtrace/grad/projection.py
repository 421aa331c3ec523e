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
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LoGra", "Projector", "gaussian_matrix", "stable_seed"]

_SCHEME = "gradtrace/logra/v1"


@dataclass(frozen=True)
class LoGra:
    """LoGra projection spec.

    rank: projected size of each factor of a matrix parameter (so ``rank**2`` per matrix) and of
        vector parameters; ``rank_rows`` / ``rank_cols`` / ``vector_rank`` override it per axis.
    seed: projection seed; stores and queries must use the same seed to be comparable.
    keep_tokens: keep the per-token projected factors (needed for token-level attribution)
        instead of summing each example over its tokens right away.
    """

    rank: int = 16
    seed: int = 0
    rank_rows: int | None = None
    rank_cols: int | None = None
    vector_rank: int | None = None
    keep_tokens: bool = False

    def __post_init__(self) -> None:
        for name in ("rank", "rank_rows", "rank_cols", "vector_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"LoGra.{name} must be a positive integer, got {value!r}")

    @property
    def k_rows(self) -> int:
        return self.rank_rows or self.rank

    @property
    def k_cols(self) -> int:
        return self.rank_cols or self.rank

    @property
    def k_vector(self) -> int:
        return self.vector_rank or self.rank

    @classmethod
    def from_dict(cls, spec: dict) -> LoGra:
        """Rebuild a spec from :meth:`to_dict` (e.g. a store's manifest), refusing other schemes."""
        if spec.get("kind") != "logra" or spec.get("scheme") != _SCHEME:
            raise ValueError(f"not a LoGra spec of this gradtrace version: {spec}")
        return cls(rank=spec["rank_rows"], rank_cols=spec["rank_cols"], vector_rank=spec["vector_rank"],
                   seed=spec["seed"])

    def to_dict(self) -> dict:
        """The spec as stored in manifests: everything that determines the projected numbers."""
        return {"kind": "logra", "scheme": _SCHEME, "distribution": "gaussian", "seed": self.seed,
                "rank_rows": self.k_rows, "rank_cols": self.k_cols, "vector_rank": self.k_vector}


def stable_seed(*parts: object) -> int:
    """A 63-bit integer derived from ``parts`` by a cryptographic hash (stable across runs)."""
    digest = hashlib.blake2b("|".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gaussian_matrix(k: int, n: int, seed: int) -> Tensor:
    """A ``[k, n]`` float32 CPU matrix with i.i.d. ``N(0, 1/k)`` entries from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(k, n, generator=gen, dtype=torch.float32).div_(math.sqrt(k))


class Projector:
    """Hands out (and caches per device) the projection matrices of a :class:`LoGra` spec."""

    def __init__(self, spec: LoGra) -> None:
        self.spec = spec
        self._cache: dict[tuple, Tensor] = {}

    def k(self, axis: str) -> int:
        return {"rows": self.spec.k_rows, "cols": self.spec.k_cols, "vector": self.spec.k_vector}[axis]

    def matrix(self, param: str, axis: str, n: int, device: torch.device | str = "cpu") -> Tensor:
        """The ``[k, n]`` matrix projecting axis ``axis`` ("rows", "cols" or "vector") of ``param``."""
        device = torch.device(device)
        key = (param, axis, n, device)
        mat = self._cache.get(key)
        if mat is None:
            k = self.k(axis)
            mat = gaussian_matrix(k, n, stable_seed(_SCHEME, self.spec.seed, param, axis, n, k)).to(device)
            self._cache[key] = mat
        return mat

    def project(self, param: str, axis: str, x: Tensor) -> Tensor:
        """Project the last dimension of ``x`` (``[..., n]``) to ``[..., k]`` in float32."""
        mat = self.matrix(param, axis, x.shape[-1], x.device)
        return torch.matmul(x.to(torch.float32), mat.t())

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
