"""``Curvature``: fitted, eigendecomposed curvature blocks and the damped inverse applied to query gradients.

For a Kronecker block with row/column eigenbases ``Q_R``, ``Q_C`` and eigenvalue grid ``Lambda`` (the K-FAC
product ``e_R e_C^T`` or the EK-FAC corrected second moments), the damped inverse-Hessian-vector product
of a gradient matrix ``V`` is

    (G + lambda I)^-1 vec(V) = vec( Q_R [ (Q_R^T V Q_C) / (Lambda + lambda) ] Q_C^T ).

Dense blocks use their own eigendecomposition. Damping is ``damping * mean(Lambda)`` per block
(``damping_mode="relative"``, default 0.1, the Kronfluence / LogIX heuristic) or a fixed ``damping``
(``"absolute"``). It is applied when the curvature is used, so re-damping needs no refit. Eigenvectors are
computed in float64 (``FitOptions.eigen_dtype``) and kept in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...common.checks import at_least
from ...store.artifact import read_artifact, write_artifact
from ...store.spec import GradientSpec
from .blocks import Block, DenseBlock, KronBlock, block_from_dict

__all__ = ["Curvature", "KronEigen", "DenseEigen", "CurvatureError", "eigh", "kron_matrices"]

FORMAT = "gradtrace-curvature"
VERSION = 2
"""2: manifest and eigendata checksummed (version 1, without checksums, still loads with a warning)."""


class CurvatureError(ValueError):
    """Curvature that cannot be used as asked (empty, singular without damping, from another model...)."""


PRECISION_DEFAULTS = {"covariance_dtype": "float32", "eigen_dtype": "float64", "offload": False}
"""The precision settings of a fit (``FitOptions``) and the values fits saved before they were recorded used."""


def eigh(matrix: Tensor, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix, computed in ``dtype`` (float64 by
    default, ``FitOptions.eigen_dtype``) and returned in float32.

    Both come back C-contiguous: LAPACK returns column-major eigenvectors, and a saved-then-loaded copy is
    row-major, so without this the products that use them take other BLAS paths in memory and after a load,
    and their results differ in the last bits.
    """
    values, vectors = torch.linalg.eigh(matrix.to(dtype))
    return values.clamp(min=0).to(torch.float32).contiguous(), vectors.to(torch.float32).contiguous()


def kron_matrices(vectors: Tensor, block: KronBlock, offsets: dict[str, tuple[int, int]]) -> Tensor:
    """``[Q, D]`` rows laid out as a spec (``offsets``: :meth:`GradientSpec.offsets`) -> ``[Q, n_rows, n_cols]``:
    each row's coordinates of a Kronecker ``block`` as its gradient matrix, the joined bias appended as the last
    column (``act_side="cols"``) or row (the shape of the block's eigenvalue grid)."""
    w0, w1 = offsets[block.name]
    matrix = vectors[:, w0:w1].reshape(vectors.shape[0], block.n_rows, block.n_cols)
    if block.bias is None:
        return matrix
    b0, b1 = offsets[block.bias]
    bias = vectors[:, b0:b1]
    return (torch.cat([matrix, bias.unsqueeze(2)], dim=2) if block.act_side == "cols"
            else torch.cat([matrix, bias.unsqueeze(1)], dim=1))


@dataclass
class KronEigen:
    """Eigendata of a Kronecker block: bases (None = identity, for one-hot sides) and the eigenvalue grid."""

    block: KronBlock
    q_rows: Tensor | None
    q_cols: Tensor | None
    eigenvalues: Tensor  # [n_rows, n_cols] (bias-augmented shape)
    rows_eig: Tensor | None = None
    cols_eig: Tensor | None = None


@dataclass
class DenseEigen:
    block: DenseBlock
    q: Tensor | None  # None: diagonal
    eigenvalues: Tensor  # [dim]


@dataclass
class Curvature:
    """Fitted curvature for the parameters of a :class:`GradientSpec`.

    kind: ``"kfac"``, ``"ekfac"`` or ``"fisher"`` (dense blocks only). fisher: ``"empirical"`` (observed
    labels), ``"true"`` (labels sampled from the model) or ``"exact"`` (expectation over every label).
    damping / damping_mode: see the module docstring; :meth:`with_damping` changes them without refitting.
    """

    kind: str
    spec: GradientSpec
    blocks: dict[str, KronEigen | DenseEigen]
    fisher: str = "empirical"
    damping: float = 0.1
    damping_mode: str = "relative"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.damping_mode not in ("relative", "absolute"):
            raise ValueError(f"damping_mode must be 'relative' or 'absolute', got {self.damping_mode!r}")
        at_least(self.damping, "damping", 0)

    def with_damping(self, damping: float, mode: str | None = None) -> Curvature:
        """The same fit with another damping (no refit): a finite number >= 0 (0: undamped, refused when used if the
        curvature is singular)."""
        return replace(self, damping=damping, damping_mode=mode or self.damping_mode)

    def precision(self) -> dict[str, Any]:
        """The fit's precision and device settings (``covariance_dtype``, ``eigen_dtype``, ``offload``) as its
        ``meta`` records them (``meta["gradtrace"]["options"]["fit"]``), and ``"assumed"``: the names of those
        a fit saved before gradtrace recorded them lacks, given their defaults (what such fits used)."""
        record = ((self.meta.get("gradtrace") or {}).get("options") or {}).get("fit") or {}
        out: dict[str, Any] = {name: record.get(name, default) for name, default in PRECISION_DEFAULTS.items()}
        out["assumed"] = [name for name in PRECISION_DEFAULTS if name not in record]
        return out

    def block_damping(self, name: str) -> float:
        eig = self.blocks[name]
        if self.damping_mode == "absolute":
            return self.damping
        return self.damping * float(eig.eigenvalues.mean())

    def check_covers(self, spec: GradientSpec, what: str = "the curvature") -> None:
        """Refuse blocks that do not cover the parameters of ``spec`` exactly once each, with their dimensions: a
        parameter without a block would be left silently unpreconditioned."""
        dims = dict(spec.params)
        covered: dict[str, int] = {}
        for eig in self.blocks.values():
            block = eig.block
            if isinstance(block, KronBlock):
                covered[block.name] = block.n_rows * block.n_cols
                if block.bias is not None:
                    covered[block.bias] = block.n_rows if block.act_side == "cols" else block.n_cols
            else:
                covered[block.name] = block.dim
        count = sum(len(eig.block.params) for eig in self.blocks.values())
        missing = [name for name in dims if name not in covered]
        extra = [name for name in covered if name not in dims]
        if missing or extra or count != len(covered):
            raise CurvatureError(f"{what}: the curvature blocks do not cover the gradients' parameters exactly "
                                 f"(no block for {missing[:5]}; blocks of unknown parameters {extra[:5]}"
                                 f"{'; a parameter in two blocks' if count != len(covered) else ''}); fit the "
                                 "curvature for these gradients")
        wrong = [(name, covered[name], dim) for name, dim in dims.items() if covered[name] != dim]
        if wrong:
            raise CurvatureError(f"{what}: curvature blocks of other sizes than the gradients' parameters "
                                 f"(name, block, gradient: {wrong[:3]}); fit the curvature for these gradients")

    def check(self) -> None:
        """Refuse blocks that would make the inverse meaningless (not covering the spec, no data, or singular and
        undamped)."""
        self.check_covers(self.spec)
        for name, eig in self.blocks.items():
            values = eig.eigenvalues
            if not torch.isfinite(values).all():
                raise CurvatureError(f"curvature of {name} has NaN/inf eigenvalues")
            if float(values.max()) == 0.0:
                raise CurvatureError(f"curvature of {name} is zero: no gradient reached it while fitting")
            lam = self.block_damping(name)
            if float(values.min()) + lam <= 0.0:
                raise CurvatureError(f"curvature of {name} is singular and damping is {lam:g}; use damping > 0 or "
                                     "damping_mode='relative'")

    # -- the inverse, and other functions of the curvature ------------------------------------------------
    def apply_inverse(self, vectors: Tensor) -> Tensor:
        """``(G + lambda I)^-1 v`` for every row of ``vectors`` ``[Q, D]`` laid out as :attr:`spec`."""
        return self.apply_function(vectors, lambda name, values: 1.0 / (values + self.block_damping(name)))

    def apply_function(self, vectors: Tensor, fn: Callable[[str, Tensor], Tensor]) -> Tensor:
        """``f(G) v`` for every row of ``vectors`` ``[Q, D]`` laid out as :attr:`spec`: each block's coordinates
        in its eigenbasis are multiplied by ``fn(block name, eigenvalues)`` (a tensor shaped like the
        eigenvalues, e.g. ``1 / (values + damping)`` for the damped inverse, :meth:`apply_inverse`)."""
        self.check()
        offsets = self.spec.offsets()
        if vectors.shape[1] != self.spec.dim:
            raise ValueError(f"vectors of dim {vectors.shape[1]}, the curvature covers {self.spec.dim}")
        out = vectors.clone().to(torch.float32)
        for name, eig in self.blocks.items():
            factor = fn(name, eig.eigenvalues)
            if isinstance(eig, KronEigen):
                self._kron_apply(out, vectors, eig, offsets, factor)
            else:
                start, stop = offsets[name]
                part = vectors[:, start:stop].to(torch.float32)
                factor = factor.to(part.device)
                if eig.q is None:
                    out[:, start:stop] = part * factor
                else:
                    q = eig.q.to(part.device)
                    out[:, start:stop] = ((part @ q) * factor) @ q.t()
        return out

    def _kron_apply(self, out: Tensor, vectors: Tensor, eig: KronEigen, offsets: dict, factor: Tensor) -> None:
        block = eig.block
        count = vectors.shape[0]
        w0, w1 = offsets[block.name]
        matrix = kron_matrices(vectors, block, offsets).to(torch.float32)
        device = matrix.device
        q_rows = eig.q_rows.to(device) if eig.q_rows is not None else None
        q_cols = eig.q_cols.to(device) if eig.q_cols is not None else None
        rotated = matrix
        if q_rows is not None:
            rotated = q_rows.t() @ rotated
        if q_cols is not None:
            rotated = rotated @ q_cols
        rotated = rotated * factor.to(device)
        if q_rows is not None:
            rotated = q_rows @ rotated
        if q_cols is not None:
            rotated = rotated @ q_cols.t()
        if block.bias is not None:
            b0, b1 = offsets[block.bias]
            if block.act_side == "cols":
                out[:, b0:b1] = rotated[:, :, -1]
                rotated = rotated[:, :, :-1]
            else:
                out[:, b0:b1] = rotated[:, -1, :]
                rotated = rotated[:, :-1, :]
        out[:, w0:w1] = rotated.reshape(count, -1)

    # -- reporting ---------------------------------------------------------------------------------
    def report(self) -> str:
        precision = self.precision()
        assumed = (f" (not recorded, defaults assumed: {', '.join(precision['assumed'])})" if precision["assumed"]
                   else "")
        lines = [f"{self.kind} curvature ({self.fisher} Fisher, damping {self.damping:g} {self.damping_mode}), "
                 f"{len(self.blocks)} blocks, fitted on {self.meta.get('examples', '?')} examples",
                 f"  statistics in {precision['covariance_dtype']}, eigendecompositions in {precision['eigen_dtype']}"
                 f"{', offloaded to the CPU' if precision['offload'] else ''}{assumed}"]
        for name, eig in self.blocks.items():
            values = eig.eigenvalues
            lam = self.block_damping(name)
            cond = float((values.max() + lam) / (values.min() + lam)) if float(values.min()) + lam > 0 else float("inf")
            shape = "x".join(str(n) for n in (eig.block.shape if isinstance(eig, KronEigen) else (eig.block.dim,)))
            lines.append(f"  {name:<40} {type(eig.block).__name__[:-5].lower():<6} {shape:>12}  mean eig "
                         f"{float(values.mean()):.3e}  damping {lam:.3e}  condition {cond:.3e}")
        return "\n".join(lines)

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """``path/curvature.json`` (spec, blocks, settings, checksums) + ``path/curvature-<hash>.safetensors``
        (eigendata), written atomically under the directory's write lock: a failed save leaves a previous fit in
        ``path`` intact; a curvature already saved there is replaced only with ``overwrite``."""
        tensors: dict[str, Tensor] = {}
        for name, eig in self.blocks.items():
            for key, value in _eigen_tensors(eig).items():
                if value is not None:
                    tensors[f"{name}::{key}"] = value
        info = {"kind": self.kind, "fisher": self.fisher, "damping": self.damping, "damping_mode": self.damping_mode,
                "spec": self.spec.to_dict(), "blocks": [eig.block.to_dict() for eig in self.blocks.values()],
                "meta": self.meta}
        write_artifact(path, "curvature", FORMAT, VERSION, info, tensors, overwrite=overwrite, what="curvature")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Curvature:
        """Load a saved fit, verified: checksums of the manifest and eigendata, every tensor of the right shape
        and finite, blocks covering the spec's parameters exactly. Raises :class:`CurvatureError` naming the
        file or block (version-1 fits, saved without checksums, load with an ``UncheckedArtifactWarning``)."""
        path = Path(path)
        info, tensors = read_artifact(path, "curvature", FORMAT, VERSION, what="curvature", error=CurvatureError)
        try:
            spec = GradientSpec.from_dict(info["spec"])
            block_list: list[Block] = [block_from_dict(data) for data in info["blocks"]]
            kind, fisher = str(info["kind"]), str(info["fisher"])
            damping, damping_mode = float(info["damping"]), str(info["damping_mode"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CurvatureError(f"{path / 'curvature.json'} is malformed ({err!r}); fit the curvature again") from None
        blocks = {block.name: _eigen_from(block, tensors, path) for block in block_list}
        unused = sorted(set(tensors) - {f"{b}::{k}" for b, eig in blocks.items() for k in _eigen_tensors(eig)})
        if unused:
            raise CurvatureError(f"{path}: the eigendata holds tensors of no block listed in curvature.json "
                                 f"({unused[:3]}); the block list was edited, fit the curvature again")
        curvature = cls(kind, spec, blocks, fisher, damping, damping_mode, info.get("meta", {}))
        curvature.check_covers(spec, f"{path}")
        return curvature


def _eigen_tensors(eig: KronEigen | DenseEigen) -> dict[str, Tensor | None]:
    """The tensors of one block's eigendata by their saved key."""
    if isinstance(eig, KronEigen):
        return {"q_rows": eig.q_rows, "q_cols": eig.q_cols, "eigenvalues": eig.eigenvalues, "rows_eig": eig.rows_eig,
                "cols_eig": eig.cols_eig}
    return {"q": eig.q, "eigenvalues": eig.eigenvalues}


def _eigen_from(block: Block, tensors: dict[str, Tensor], path: Path) -> KronEigen | DenseEigen:
    """One block's eigendata from the loaded tensors; refuses a missing eigenvalue grid, a tensor of the wrong
    shape or dtype, and NaN/inf (a corrupted file would otherwise give NaN scores)."""
    if isinstance(block, KronBlock):
        rows, cols = block.shape
        shapes = {"q_rows": (rows, rows), "q_cols": (cols, cols), "eigenvalues": (rows, cols), "rows_eig": (rows,),
                  "cols_eig": (cols,)}
    else:
        shapes = {"q": (block.dim, block.dim), "eigenvalues": (block.dim,)}
    found: dict[str, Tensor | None] = {}
    for key, shape in shapes.items():
        value = tensors.get(f"{block.name}::{key}")
        if value is not None:
            if tuple(value.shape) != shape or value.dtype != torch.float32:
                raise CurvatureError(f"{path}: {key} of block {block.name} is {value.dtype} "
                                     f"{tuple(value.shape)}, expected float32 {shape}; fit the curvature again")
            if not torch.isfinite(value).all():
                raise CurvatureError(f"{path}: {key} of block {block.name} holds NaN/inf (a corrupted file); fit "
                                     "the curvature again")
        found[key] = value
    if found["eigenvalues"] is None:
        raise CurvatureError(f"{path}: the eigenvalues of block {block.name} are missing; fit the curvature again")
    if isinstance(block, KronBlock):
        return KronEigen(block, found["q_rows"], found["q_cols"], found["eigenvalues"], found["rows_eig"],
                         found["cols_eig"])
    return DenseEigen(block, found["q"], found["eigenvalues"])
