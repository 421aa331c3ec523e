"""Ghost (factorized) inner products of per-example gradients, tiled to a memory budget.

For two outer terms ``G_i = sum_t r_it c_it^T`` and ``H_j = sum_u r'_ju c'_ju^T``

    <G_i, H_j> = sum_{t,u} (r_it . r'_ju) (c_it . c'_ju),

so the ``(E1, E2)`` matrix of inner products needs only token-level Gram matrices, never a weight-sized
gradient. The ``[tile_i*T1, tile_j*T2]`` Gram blocks are the only temporaries; tiles over examples (and,
for very long sequences, over tokens) keep them under ``max_bytes``. Index factors (embeddings: one-hot
rows given by token ids) use equality / gather instead of a matmul: ``e_a . e_b = [a == b]`` and
``e_a . r = r[a]``.

Everything is accumulated in float32 whatever the factors' dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .terms import OuterTerm, is_index

__all__ = ["DEFAULT_MAX_BYTES", "ghost_diag", "ghost_inner", "ghost_sq_norms", "tile_sizes"]

DEFAULT_MAX_BYTES = 256 * 2**20
_TEMPS = 3  # Gram blocks alive at once: rows, cols and their product


def tile_sizes(e1: int, t1: int, e2: int, t2: int, max_bytes: int) -> tuple[int, int, int, int]:
    """Example and token tile sizes ``(ti, tt1, tj, tt2)`` so that ``3 * 4 * ti*tt1 * tj*tt2 <= max_bytes``.

    Tokens are tiled only when a single pair of examples does not fit.
    """
    budget = max(1, max_bytes // (4 * _TEMPS))
    tt1, tt2 = t1, t2
    while tt1 * tt2 > budget and (tt1 > 1 or tt2 > 1):
        if tt1 >= tt2:
            tt1 = math.ceil(tt1 / 2)
        else:
            tt2 = math.ceil(tt2 / 2)
    pairs = max(1, budget // (tt1 * tt2))
    ti = min(e1, max(1, int(math.sqrt(pairs))))
    tj = min(e2, max(1, pairs // ti))
    ti = min(e1, max(ti, pairs // max(tj, 1)))
    return ti, tt1, tj, tt2


def _gram(x: Tensor, y: Tensor, nx: int) -> Tensor:
    """Token-level Gram block ``[n1, n2]`` of two factor slices (flattened over examples and tokens).

    x: ``[n1, w]`` float or ``[n1]`` ids; y: ``[n2, w]`` float or ``[n2]`` ids.
    """
    if is_index(x) and is_index(y):
        return ((x.unsqueeze(1) == y.unsqueeze(0)) & (x >= 0).unsqueeze(1)).to(torch.float32)
    if is_index(x):
        return _gram(y, x, nx).t()
    if is_index(y):
        # e_{y_u} . x_t = x_t[y_u]
        picked = x.to(torch.float32).index_select(1, y.clamp(min=0))
        return picked * (y >= 0).to(torch.float32).unsqueeze(0)
    return x.to(torch.float32) @ y.to(torch.float32).t()


def _flat(f: Tensor) -> Tensor:
    return f.reshape(-1) if is_index(f) else f.reshape(-1, f.shape[-1])


def ghost_inner(a: OuterTerm, b: OuterTerm, *, per_token: bool = False,
                max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """Inner products of every example of ``a`` with every example of ``b``.

    Returns ``[E1, E2]``, or ``[E1, T1, E2]`` with ``per_token=True`` (token ``t`` of ``a``'s example's
    share; summing over ``t`` gives the ``[E1, E2]`` result exactly).
    """
    if (a.n_rows, a.n_cols) != (b.n_rows, b.n_cols):
        raise ValueError(f"gradient shapes differ: {(a.n_rows, a.n_cols)} vs {(b.n_rows, b.n_cols)}")
    e1, t1 = a.rows.shape[:2]
    e2, t2 = b.rows.shape[:2]
    device = a.rows.device
    out = torch.zeros((e1, t1, e2) if per_token else (e1, e2), dtype=torch.float32, device=device)
    ti, tt1, tj, tt2 = tile_sizes(e1, t1, e2, t2, max_bytes)
    for i0 in range(0, e1, ti):
        i1 = min(e1, i0 + ti)
        for j0 in range(0, e2, tj):
            j1 = min(e2, j0 + tj)
            for s0 in range(0, t1, tt1):
                s1 = min(t1, s0 + tt1)
                ra, ca = _flat(a.rows[i0:i1, s0:s1]), _flat(a.cols[i0:i1, s0:s1])
                for u0 in range(0, t2, tt2):
                    u1 = min(t2, u0 + tt2)
                    rb, cb = _flat(b.rows[j0:j1, u0:u1]), _flat(b.cols[j0:j1, u0:u1])
                    prod = _gram(ra, rb, a.n_rows)
                    prod.mul_(_gram(ca, cb, a.n_cols))
                    block = prod.view(i1 - i0, s1 - s0, j1 - j0, u1 - u0).sum(3)
                    if per_token:
                        out[i0:i1, s0:s1, j0:j1] += block
                    else:
                        out[i0:i1, j0:j1] += block.sum(1)
    return out


def ghost_diag(a: OuterTerm, b: OuterTerm, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """``[E]`` inner products ``<A_i, B_i>`` of the same example in two terms (``a is b``: squared norms)."""
    if a.num_examples != b.num_examples:
        raise ValueError(f"example counts differ: {a.num_examples} vs {b.num_examples}")
    e, t1, t2 = a.num_examples, a.num_tokens, b.num_tokens
    out = torch.zeros(e, dtype=torch.float32, device=a.rows.device)
    per_example = t1 * t2 * 4 * _TEMPS
    if per_example > max_bytes:  # very long sequences: tile tokens with the pairwise kernel
        for i in range(e):
            one_a = OuterTerm(a.rows[i:i + 1], a.cols[i:i + 1], a.n_rows, a.n_cols)
            one_b = OuterTerm(b.rows[i:i + 1], b.cols[i:i + 1], b.n_rows, b.n_cols)
            out[i] = ghost_inner(one_a, one_b, max_bytes=max_bytes)[0, 0]
        return out
    step = max(1, min(e, max_bytes // per_example))
    for i0 in range(0, e, step):
        i1 = min(e, i0 + step)
        rows = _batched_gram(a.rows[i0:i1], b.rows[i0:i1])
        out[i0:i1] = (rows.mul_(_batched_gram(a.cols[i0:i1], b.cols[i0:i1]))).sum((1, 2))
    return out


def ghost_sq_norms(a: OuterTerm, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """``[E]`` squared Frobenius norms ``||G_i||^2 = sum_{t,u} (r_t . r_u)(c_t . c_u)`` per example."""
    return ghost_diag(a, a, max_bytes=max_bytes)


def _batched_gram(f: Tensor, g: Tensor) -> Tensor:
    """``[E, Tf, Tg]`` per-example Gram matrices between the tokens of two factors."""
    if is_index(f) and is_index(g):
        return ((f.unsqueeze(2) == g.unsqueeze(1)) & (f >= 0).unsqueeze(2)).to(torch.float32)
    if is_index(f):
        return _batched_gram(g, f).transpose(1, 2)
    f = f.to(torch.float32)
    if is_index(g):
        # e_{g_u} . f_t = f_t[g_u]
        picked = torch.gather(f, 2, g.clamp(min=0).unsqueeze(1).expand(-1, f.shape[1], -1))
        return picked * (g >= 0).to(torch.float32).unsqueeze(1)
    return torch.bmm(f, g.to(torch.float32).transpose(1, 2))
