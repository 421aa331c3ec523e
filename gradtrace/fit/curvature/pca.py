"""PCA-initialised LoGra: project onto the top eigenvectors of fitted K-FAC factors.

In the Kronecker eigenbasis K-FAC is diagonal, so projecting each factor onto its top eigenvectors keeps the top
Kronecker eigen-directions of the curvature. Building the basis needs a fitted curvature, so it lives here;
:mod:`gradtrace.projection` (below the curvature) sees only the :class:`~gradtrace.projection.logra.PCABasis`
protocol, and :func:`register_pca` plugs :func:`pca_logra` and :func:`pca_basis` into ``LoGra.pca`` and
``LoGra(init="pca", basis=...)``.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...projection.logra import LoGra, PCABasis, register_pca
from .curvature import Curvature
from .fit import fit_curvature_from

__all__ = ["KFACBasis", "pca_basis", "pca_logra"]


class KFACBasis:
    """The :class:`~gradtrace.projection.logra.PCABasis` of a K-FAC ``curvature`` fitted on exact gradients without
    joined biases: each factor's eigenvectors, largest eigenvalue first."""

    def __init__(self, curvature: Any) -> None:
        self.curvature = curvature

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the eigendata: stores projected with different bases are refused."""
        h = hashlib.blake2b(digest_size=8)
        for name in sorted(self.curvature.blocks):
            eig = self.curvature.blocks[name]
            for value in (getattr(eig, "q_rows", None), getattr(eig, "q_cols", None), getattr(eig, "q", None),
                          eig.eigenvalues):
                if value is not None:
                    h.update(name.encode())
                    h.update(value.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def directions(self, param: str, axis: str, n: int, k: int) -> Tensor:
        """``[k, n]``: the top-``k`` eigenvectors (rows) of ``param``'s factor on ``axis`` (``"rows"``, ``"cols"``,
        ``"vector"``); rows of zeros past the ``n`` directions there are."""
        eig = self.curvature.blocks.get(param)
        if eig is None:
            raise ValueError(f"the PCA basis has no factors for {param}: fit it on the same layers")
        if axis == "vector":
            vectors, values = getattr(eig, "q", None), eig.eigenvalues
        else:
            if getattr(eig.block, "bias", None) is not None:
                raise ValueError(f"{param}'s basis joins a bias column: fit it with join_bias=False (LoGra.pca does)")
            vectors = eig.q_rows if axis == "rows" else eig.q_cols
            values = eig.rows_eig if axis == "rows" else eig.cols_eig
        if values is None or values.numel() != n:
            raise ValueError(f"the PCA basis of {param} ({axis}) has {None if values is None else values.numel()} "
                             f"directions, the gradient has {n}")
        order = torch.argsort(values, descending=True)[: min(k, n)]
        if vectors is None:  # diagonal factor (one-hot side): the top-k coordinates
            top = torch.zeros(len(order), n)
            top[torch.arange(len(order)), order] = 1.0
        else:
            top = vectors[:, order].t().to(torch.float32)
        if k > n:  # keep the declared shape: the extra directions carry nothing
            top = torch.cat([top, torch.zeros(k - n, n)])
        return top.contiguous()


def pca_basis(basis: Any) -> PCABasis:
    """A :class:`~gradtrace.projection.logra.PCABasis` from a fitted :class:`Curvature`, its directory, or a basis
    (returned as is)."""
    if isinstance(basis, (str, Path)):
        basis = Curvature.load(basis)
    if hasattr(basis, "directions") and hasattr(basis, "fingerprint"):
        return basis
    if hasattr(basis, "blocks"):  # a fitted Curvature (anything holding its eigendata)
        return KFACBasis(basis)
    raise TypeError(f"LoGra(init='pca') takes basis= a fitted K-FAC Curvature or its directory, got "
                    f"{type(basis).__name__}")


def pca_logra(model: Any, data: Any, loss_fn: Any = None, *, rank: int = 16, fisher: str = "empirical",
              layers: Any = None, exclude: Any = None, ranks: Any = (), **options: Any) -> LoGra:
    """Fit K-FAC factors on exact gradients of ``data`` and return a PCA-initialised LoGra spec (``LoGra.pca``)."""
    curvature = fit_curvature_from(model, data, loss_fn, None, {**options, "kind": "kfac", "fisher": fisher,
                                                             "layers": layers, "exclude": exclude, "join_bias": False})
    return LoGra(rank=rank, init="pca", basis=curvature, ranks=ranks,
                 **{k: v for k, v in options.items() if k == "seed"})


register_pca(fit=pca_logra, basis=pca_basis)
