"""The cost model: FLOPs, bytes and calls of each way to compute an operation, and the choice between them.

A per-example gradient of a matrix parameter can be used in three representations:

* **factorized** -- per-token factors ``r_t``, ``c_t`` (``T (n_r + n_c)`` numbers per example);
* **materialized** -- the summed ``n_r x n_c`` matrix;
* **projected** -- a ``k``-vector (LoGra or a dense/sparse sketch; a storage decision, not an exact route).

For inner products and norms the exact routes are ``"ghost"`` (factorized, see :mod:`ghost`) and
``"materialize"``. Their cost is estimated from shapes alone, as ``flops / F + bytes / BW + calls * c``
with the machine's measured matmul rate ``F``, memory bandwidth ``BW`` and per-kernel overhead ``c``
(:meth:`MachineProfile.calibrate`), and the cheaper route is chosen. Callers can always pin a route; every
route gives the same numbers. ``bench/routing.py`` checks the choice against measured timings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache

import torch

from .ghost import DEFAULT_MAX_BYTES, tile_sizes
from .terms import OuterTerm, Term, VectorTerm, is_index

__all__ = ["ROUTES", "CostModel", "MachineProfile", "RouteCost", "TermShape", "default_cost_model"]

ROUTES = ("ghost", "materialize")
_F32 = 4


@dataclass(frozen=True)
class MachineProfile:
    """Throughput figures of one device.

    flops_per_s: sustained float32 matmul rate; bytes_per_s: memory bandwidth of large copies;
    call_overhead_s: fixed cost of one kernel launch / Python dispatch.
    """

    flops_per_s: float
    bytes_per_s: float
    call_overhead_s: float
    device: str = "cpu"

    @classmethod
    def calibrate(cls, device: str | torch.device = "cpu", seconds: float = 0.15) -> MachineProfile:
        """Measure this device (about ``3 * seconds``): a 512^3 matmul, a 32 MiB copy, tiny kernels."""
        device = torch.device(device)

        def timed(fn) -> float:
            fn()
            _sync(device)
            reps, start = 0, time.perf_counter()
            while True:
                fn()
                reps += 1
                _sync(device)
                elapsed = time.perf_counter() - start
                if elapsed > seconds or reps >= 1000:
                    return elapsed / reps

        a = torch.full((512, 512), 0.5, device=device)  # timing only: no draw from the user's random stream
        flops = 2 * 512**3 / timed(lambda: a @ a)
        big = torch.empty(8 * 2**20, device=device)
        bandwidth = 2 * big.numel() * _F32 / timed(lambda: big.clone())
        tiny = torch.zeros(4, device=device)
        overhead = timed(lambda: tiny.add_(1))
        return cls(flops, bandwidth, overhead, str(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TermShape:
    """Shape of one term: ``examples x tokens`` of factors of widths ``n_rows``/``n_cols`` (``index_*``:
    one-hot ids). Vector terms have ``n_cols = 0``; dense (already summed) terms ``tokens = 0``."""

    examples: int
    tokens: int
    n_rows: int
    n_cols: int
    index_rows: bool = False
    index_cols: bool = False

    @classmethod
    def of(cls, term: Term) -> TermShape:
        if isinstance(term, OuterTerm):
            return cls(term.num_examples, term.num_tokens, term.n_rows, term.n_cols,
                       is_index(term.rows), is_index(term.cols))
        if isinstance(term, VectorTerm):
            return cls(term.num_examples, term.num_tokens, term.shape[0], 0)
        return cls(term.num_examples, 0, math.prod(term.shape), 0)

    @property
    def numel(self) -> int:
        """Size of one example's materialized gradient."""
        return self.n_rows * max(self.n_cols, 1)

    @property
    def outer(self) -> bool:
        return self.n_cols > 0 and self.tokens > 0


@dataclass(frozen=True)
class RouteCost:
    route: str
    flops: float
    bytes: float
    calls: float

    def seconds(self, profile: MachineProfile) -> float:
        compute = self.flops / profile.flops_per_s + self.bytes / profile.bytes_per_s
        return compute + self.calls * profile.call_overhead_s


def _factor_width(width: int, index: bool) -> int:
    return 0 if index else width


def _materialize_cost(s: TermShape) -> tuple[float, float, float]:
    """FLOPs, bytes and calls to form ``[E, numel]`` from a term."""
    if s.tokens == 0:
        return 0.0, 0.0, 0.0
    out_bytes = s.examples * s.numel * _F32
    if not s.outer:  # vector term: a sum over tokens
        return s.examples * s.tokens * s.n_rows, s.examples * s.tokens * s.n_rows * _F32 + out_bytes, 1
    if s.index_rows or s.index_cols:  # scatter-add into a zeroed [E, n_rows, n_cols]
        width = s.n_cols if s.index_rows else s.n_rows
        moved = s.examples * s.tokens * width * _F32
        return s.examples * s.tokens * width, 2 * out_bytes + 2 * moved, 3
    flops = 2.0 * s.examples * s.tokens * s.n_rows * s.n_cols
    read = s.examples * s.tokens * (s.n_rows + s.n_cols) * _F32
    return flops, out_bytes + read, 1


class CostModel:
    """Estimates and chooses routes for inner products, norms and storage of per-example gradients.

    profile: the device's :class:`MachineProfile` (measured on first use when omitted).
    """

    def __init__(self, profile: MachineProfile | None = None) -> None:
        self._profile = profile

    @property
    def profile(self) -> MachineProfile:
        if self._profile is None:
            self._profile = _calibrated("cpu")
        return self._profile

    # -- inner products --------------------------------------------------------------------------
    def inner_costs(self, a: TermShape, b: TermShape, max_bytes: int = DEFAULT_MAX_BYTES) -> list[RouteCost]:
        """Costs of the possible routes for the ``[E1, E2]`` inner products of two terms."""
        mat_a, mat_b = _materialize_cost(a), _materialize_cost(b)
        numel = a.numel
        chunks = max(1.0, (a.examples + b.examples) * numel * _F32 / max_bytes)
        matmul_flops = 2.0 * a.examples * b.examples * numel
        matmul_bytes = (a.examples + b.examples) * numel * _F32 * math.sqrt(chunks) + a.examples * b.examples * _F32
        costs = [RouteCost("materialize", mat_a[0] + mat_b[0] + matmul_flops, mat_a[1] + mat_b[1] + matmul_bytes,
                           mat_a[2] + mat_b[2] + chunks)]
        if a.outer and b.outer:
            costs.append(self._ghost_cost(a, b, max_bytes))
        return costs

    def _ghost_cost(self, a: TermShape, b: TermShape, max_bytes: int) -> RouteCost:
        pairs = float(a.examples) * b.examples * a.tokens * b.tokens
        width = _factor_width(a.n_rows, a.index_rows or b.index_rows) + _factor_width(
            a.n_cols, a.index_cols or b.index_cols)
        flops = 2.0 * pairs * width + 2.0 * pairs
        reads = (a.examples * a.tokens + b.examples * b.tokens) * (a.n_rows + a.n_cols) * _F32
        ti, tt1, tj, tt2 = tile_sizes(a.examples, a.tokens, b.examples, b.tokens, max_bytes)
        tiles = (math.ceil(a.examples / ti) * math.ceil(a.tokens / tt1) * math.ceil(b.examples / tj)
                 * math.ceil(b.tokens / tt2))
        # each Gram block is written, multiplied in place and read by the reduction
        temp_bytes = pairs * _F32 * 5
        if a.index_rows or a.index_cols:
            temp_bytes += pairs * _F32 * 2
        return RouteCost("ghost", flops, temp_bytes + reads * tiles ** 0.5, tiles * 8)

    def choose_inner(self, a: TermShape, b: TermShape, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        costs = self.inner_costs(a, b, max_bytes)
        return min(costs, key=lambda c: c.seconds(self.profile)).route

    def param_inner_costs(self, a: list[TermShape], b: list[TermShape],
                          max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, RouteCost]:
        """Route costs for one parameter whose gradients are sums of terms on each side.

        ``materialize`` forms each side once (all terms summed) and multiplies; ``ghost`` takes every
        pair of terms, factorized where both are outer terms and materialized otherwise.
        """
        def total(costs: list[RouteCost], route: str) -> RouteCost:
            return RouteCost(route, sum(c.flops for c in costs), sum(c.bytes for c in costs),
                             sum(c.calls for c in costs))

        parts = [RouteCost("m", *_materialize_cost(s)) for s in a + b]
        matmul = self.inner_costs(TermShape(a[0].examples, 0, a[0].n_rows, a[0].n_cols),
                                  TermShape(b[0].examples, 0, b[0].n_rows, b[0].n_cols), max_bytes)[0]
        out = {"materialize": total([*parts, matmul], "materialize")}
        if any(x.outer and y.outer for x in a for y in b):
            pairs = []
            for x in a:
                for y in b:
                    options = {c.route: c for c in self.inner_costs(x, y, max_bytes)}
                    pairs.append(options.get("ghost", options["materialize"]))
            out["ghost"] = total(pairs, "ghost")
        return out

    def choose_param_inner(self, a: list[TermShape], b: list[TermShape], max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        costs = self.param_inner_costs(a, b, max_bytes)
        return min(costs.values(), key=lambda c: c.seconds(self.profile)).route

    # -- norms -----------------------------------------------------------------------------------
    def norm_costs(self, a: TermShape, max_bytes: int = DEFAULT_MAX_BYTES) -> list[RouteCost]:
        mat = _materialize_cost(a)
        costs = [RouteCost("materialize", mat[0] + 2.0 * a.examples * a.numel,
                           mat[1] + a.examples * a.numel * _F32, mat[2] + 2)]
        if a.outer:
            pairs = float(a.examples) * a.tokens * a.tokens
            width = _factor_width(a.n_rows, a.index_rows) + _factor_width(a.n_cols, a.index_cols)
            steps = max(1.0, pairs * _F32 * 3 / max_bytes)
            costs.append(RouteCost("ghost", 2.0 * pairs * width + 2 * pairs, pairs * _F32 * 5, steps * 4))
        return costs

    def choose_norm(self, a: TermShape, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        return min(self.norm_costs(a, max_bytes), key=lambda c: c.seconds(self.profile)).route

    # -- storage ---------------------------------------------------------------------------------
    @staticmethod
    def storage_bytes(a: TermShape, itemsize: int = _F32, projected_dim: int | None = None) -> dict[str, int]:
        """Bytes to store the term's examples factorized, materialized and (if given) projected."""
        out = {"materialized": a.examples * a.numel * itemsize}
        if a.tokens > 0:
            widths = (8 if a.index_rows else a.n_rows * itemsize) + (
                (8 if a.index_cols else a.n_cols * itemsize) if a.n_cols else 0)
            out["factorized"] = a.examples * a.tokens * widths
        if projected_dim is not None:
            out["projected"] = a.examples * projected_dim * itemsize
        return out

    def choose_storage(self, a: TermShape, itemsize: int = _F32, projected_dim: int | None = None) -> str:
        sizes = self.storage_bytes(a, itemsize, projected_dim)
        return min(sizes, key=sizes.get)


@cache
def _calibrated(device: str) -> MachineProfile:
    return MachineProfile.calibrate(device)


_DEFAULT: CostModel | None = None


def default_cost_model() -> CostModel:
    """The process-wide cost model (calibrated on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CostModel()
    return _DEFAULT

