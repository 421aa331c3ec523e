"""Whole-model curvature from matrix-vector products: Gauss-Newton / Fisher operators over *all* captured
parameters (cross-layer terms included), and the two solvers that use them (Arnoldi, conjugate gradient).

Operators (``matmul([K, P]) -> [K, P]`` and ``diagonal() -> [P]``, ``P`` = the captured parameters in the
gradients' layout):

* :class:`GGNOperator` -- the generalised Gauss-Newton matrix of the per-example loss over the data,
  ``G = (1/N) sum_n J_n^T H_n J_n`` (``J_n``: Jacobian of example ``n``'s outputs, ``H_n``: Hessian of its loss in
  the outputs), for gradtrace's losses: :func:`~gradtrace.loss.functions.classification_loss` (``H = diag(p) - p p^T``,
  equal to the exact Fisher), :func:`~gradtrace.loss.functions.regression_loss` (``H = I``) and
  :func:`~gradtrace.loss.functions.causal_lm_loss` (the softmax Hessian of every target token, summed). Products are
  ``J^T (H (J V))``: forward-mode ``torch.func.jvp`` (batched over vectors with ``vmap``) then one ``vjp``, per
  data batch -- one pass over the data per product, nothing per example stored.
* :class:`EmpiricalFisherOperator` -- ``F = (1/N) sum_i g_i g_i^T`` from stored per-example gradients
  (streamed; no model pass).

Solvers: :func:`arnoldi` (the top eigenpairs from a Krylov basis with full re-orthogonalisation; Schioppa et
al. 2022) and :func:`conjugate_gradient` (``(G + lambda I) X = B`` for many right-hand sides at once, Jacobi
preconditioned).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...common.modules import unwrap
from ...loss.functions import MODEL_KEYS, causal_lm_loss, classification_loss, default_loss, lm_labels, regression_loss
from .curvature import CurvatureError

__all__ = ["GGNOperator", "EmpiricalFisherOperator", "arnoldi", "conjugate_gradient", "dense_matrix",
           "arnoldi_bytes", "loss_kind"]

_KINDS = {causal_lm_loss: "lm", classification_loss: "cls", regression_loss: "reg"}


def loss_kind(loss_fn: Callable | None, sample_batch: Any) -> str:
    """``"cls"``, ``"reg"``, ``"lm"`` for gradtrace's losses (``None``: the default loss of the batch), else
    ``"custom"`` (no known output Hessian: only the empirical Fisher applies)."""
    fn = loss_fn or default_loss(sample_batch)
    return _KINDS.get(fn, "lm" if getattr(fn, "__name__", "") == "_causal_lm_loss_once" else "custom")


def _strip_ids(batch: Any) -> Any:
    return {k: v for k, v in batch.items() if k != "id"} if isinstance(batch, dict) else batch


def _to(batch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    def move(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.to(device, dtype) if value.is_floating_point() else value.to(device)
        return value

    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    return type(batch)(move(v) for v in batch)


class GGNOperator:
    """``G = (1/N) sum_n J_n^T H_n J_n`` over ``data`` for the captured parameters ``params`` (see module doc).

    Args:
        model: the model, at the weights whose curvature is wanted (not modified).
        data: the batches (iterated once per product; a one-shot iterator is read into a list).
        loss_fn: one of gradtrace's classification / regression / causal-LM losses (None: the batch's default).
        params: ``[(name, numel), ...]`` in vector order -- the gradients' :class:`GradientSpec` params.
        precision: ``"float32"`` or ``"float64"`` (products with a float64 copy of the model: for tests and
            ill-conditioned solves; twice the memory).
        chunk: vectors per batched forward-mode pass (memory: ``chunk`` x the batch's activations).
    """

    def __init__(self, model: nn.Module, data: Iterable[Any], loss_fn: Callable | None,
                 params: Sequence[tuple[str, int]], *, precision: str = "float32", chunk: int = 32) -> None:
        if precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")
        self.data = [_strip_ids(b) for b in data]
        if not self.data:
            raise ValueError("whole-model curvature: the data is empty")
        self.kind = loss_kind(loss_fn, self.data[0])
        if self.kind == "custom":
            raise ValueError("the Gauss-Newton matrix needs the Hessian of the loss in the model's outputs, which "
                             "gradtrace knows for gradtrace.loss.functions.classification_loss, regression_loss and "
                             "causal_lm_loss; use one of them or fisher='empirical' (from the stored gradients)")
        self.dtype = torch.float64 if precision == "float64" else torch.float32
        inner = unwrap(model)
        self.model = copy.deepcopy(inner).to(self.dtype) if self.dtype != torch.float32 else inner
        named = dict(self.model.named_parameters())
        missing = [n for n, _ in params if n not in named]
        if missing:
            raise ValueError(f"whole-model curvature: the gradients cover parameters the model does not have "
                             f"({missing[:3]}); pass the model the gradients were collected from")
        wrong = [(n, d, named[n].numel()) for n, d in params if named[n].numel() != d][:3]
        if wrong:
            raise ValueError(f"whole-model curvature works on exact gradients; (name, stored dim, parameter size) "
                             f"differ for {wrong}: collect the gradients without a projection")
        self.params = list(params)
        self.shapes = {n: tuple(named[n].shape) for n, _ in params}
        self.dim = sum(d for _, d in params)
        self.chunk = chunk
        self.device = next(iter(named.values())).device
        self.examples = sum(self._rows(b) for b in self.data)
        self.products = 0  # number of [K, P] products computed (each a pass over the data)

    def _rows(self, batch: Any) -> int:
        if isinstance(batch, dict):
            key = "input_ids" if "input_ids" in batch else next(k for k, v in batch.items() if isinstance(v, Tensor))
            return int(batch[key].shape[0])
        return int(batch[0].shape[0])

    # -- one batch -------------------------------------------------------------------------------------
    def _forward(self, batch: Any) -> tuple[Callable[[dict[str, Tensor]], Tensor], Tensor | None]:
        """``f(params) -> outputs`` for this batch and, for an LM, the mask of target tokens ``[B, T]``."""
        from torch.func import functional_call

        frozen = {n: p.detach() for n, p in self.model.named_parameters() if n not in self.shapes}
        frozen.update({n: b for n, b in self.model.named_buffers()})
        mask = None
        if self.kind == "lm":
            kwargs = {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}
            labels = lm_labels(batch).to(self.device)
            shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
            mask = shifted != -100
            args: tuple = ()
        elif isinstance(batch, dict):
            kwargs, args = {k: v for k, v in batch.items() if k != "labels"}, ()
        else:
            kwargs, args = {}, (batch[0],)

        def outputs(p: dict[str, Tensor]) -> Tensor:
            out = functional_call(self.model, {**frozen, **p}, args, kwargs)
            return getattr(out, "logits", out)

        return outputs, mask

    def _hessian(self, outputs: Tensor, mask: Tensor | None) -> Callable[[Tensor], Tensor]:
        """``u [K, *out] -> H u``: the loss's Hessian in the outputs, per example (and token)."""
        if self.kind == "reg":
            return lambda u: u
        probs = torch.softmax(outputs.detach(), dim=-1)  # [B, C] or [B, T, V]
        weight = None if mask is None else mask.unsqueeze(-1).to(probs.dtype)

        def apply(u: Tensor) -> Tensor:
            hu = probs * (u - (probs * u).sum(-1, keepdim=True))
            return hu if weight is None else hu * weight

        return apply

    def matmul(self, vectors: Tensor) -> Tensor:
        """``G V^T`` for ``vectors [K, P]`` (rows in the gradients' layout): ``[K, P]`` in the operator's dtype."""
        from torch.func import jvp, vjp, vmap

        vectors = vectors.to(self.device, self.dtype)
        out = torch.zeros_like(vectors)
        named = dict(self.model.named_parameters())
        primals = {n: named[n].detach() for n in self.shapes}
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in self.data:
                batch = _to(batch, self.device, self.dtype)
                forward, mask = self._forward(batch)
                outputs, pullback = vjp(forward, primals)
                hessian = self._hessian(outputs, mask)
                for start in range(0, vectors.shape[0], self.chunk):
                    tangents = self._unflatten(vectors[start:start + self.chunk])
                    try:
                        jv = vmap(lambda t, f=forward: jvp(f, (primals,), (t,))[1])(tangents)  # [k, *outputs]
                    except (NotImplementedError, RuntimeError) as error:
                        raise CurvatureError(
                            f"whole-model curvature needs forward-mode differentiation through the model, which "
                            f"failed: {str(error).splitlines()[0]} (for a Hugging Face model, load it with "
                            "attn_implementation='eager')") from error
                    (grads,) = vmap(pullback)(hessian(jv))
                    out[start:start + self.chunk] += self._flatten(grads)
        finally:
            self.model.train(was_training)
        self.products += 1
        return out / self.examples

    def _unflatten(self, rows: Tensor) -> dict[str, Tensor]:
        out, start = {}, 0
        for name, dim in self.params:
            out[name] = rows[:, start:start + dim].reshape(rows.shape[0], *self.shapes[name])
            start += dim
        return out

    def _flatten(self, grads: dict[str, Tensor]) -> Tensor:
        return torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name, _ in self.params], dim=1)


class EmpiricalFisherOperator:
    """``F = (1/N) sum_i g_i g_i^T`` of stored per-example gradients (a store or :class:`GradientSet`),
    streamed in blocks of ``block_rows``: ``F V^T = (1/N) G^T (G V^T)``."""

    def __init__(self, source: Any, *, block_rows: int = 8192, device: Any = None, precision: str = "float32"):
        self.source = source
        self.block_rows = block_rows
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = torch.float64 if precision == "float64" else torch.float32
        self.dim = source.spec.dim
        self.examples = len(source)
        if self.examples == 0:
            raise ValueError("whole-model curvature: the training gradients are empty")
        self.products = 0

    def _blocks(self) -> Iterable[Tensor]:
        for _, block in self.source.iter_blocks(self.block_rows, self.device):
            yield block.to(self.dtype)

    def matmul(self, vectors: Tensor) -> Tensor:
        vectors = vectors.to(self.device, self.dtype)
        out = torch.zeros_like(vectors)
        for block in self._blocks():
            out += (vectors @ block.t()) @ block
        self.products += 1
        return out / self.examples

    def diagonal(self) -> Tensor:
        total = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
        for block in self._blocks():
            total += block.pow(2).sum(0)
        return total / self.examples


# -- solvers ---------------------------------------------------------------------------------------------
def dense_matrix(matmul: Callable[[Tensor], Tensor], dim: int, *, chunk: int = 256,
                 dtype: torch.dtype = torch.float64, device: Any = None) -> Tensor:
    """The operator as a dense symmetric ``[dim, dim]`` matrix, from products with the identity's rows."""
    out = torch.empty(dim, dim, dtype=dtype, device=device)
    for start in range(0, dim, chunk):
        stop = min(dim, start + chunk)
        eye = torch.zeros(stop - start, dim, dtype=dtype, device=device)
        eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
        out[start:stop] = matmul(eye).to(dtype)
    return (out + out.t()) / 2


def arnoldi_bytes(iterations: int, rank: int, dim: int, itemsize: int = 4) -> int:
    """Memory of :func:`arnoldi`: the Krylov basis (``iterations + 1`` vectors) and the ``rank`` kept eigenvectors."""
    return (iterations + 1 + rank) * dim * itemsize + iterations * iterations * 8


def arnoldi(matmul: Callable[[Tensor], Tensor], dim: int, rank: int, iterations: int, *, seed: int = 0,
            dtype: torch.dtype = torch.float32, device: Any = None) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of a symmetric PSD operator from ``iterations`` Arnoldi steps.

    Each step multiplies the newest basis vector by the operator and orthogonalises the result against the whole
    basis (classical Gram-Schmidt, twice); the projected matrix ``H = Q^T G Q`` is symmetrised and
    eigendecomposed in float64 (Rayleigh-Ritz). When the Krylov space becomes invariant (e.g. ``G`` has
    fewer distinct eigenvalues than ``iterations``) the basis continues with a random vector orthogonal to it, so
    ``iterations = dim`` spans the whole space and gives the exact eigendecomposition.

    Returns:
        ``eigenvalues [rank]`` (descending, clamped at 0) and ``eigenvectors [rank, dim]`` (orthonormal rows).
    """
    if not 1 <= rank <= iterations <= dim:
        raise ValueError(f"arnoldi needs 1 <= rank ({rank}) <= iterations ({iterations}) <= parameters ({dim})")
    generator = torch.Generator().manual_seed(seed)
    basis = torch.zeros(iterations + 1, dim, dtype=dtype, device=device)
    hessenberg = torch.zeros(iterations + 1, iterations, dtype=torch.float64)
    breakdown = 1e-6 if dtype == torch.float32 else 1e-12

    def orthogonalize(vector: Tensor, count: int) -> tuple[Tensor, Tensor]:
        coefficients = torch.zeros(count, dtype=dtype, device=device)
        for _ in range(2):
            step = basis[:count] @ vector
            vector = vector - step @ basis[:count]
            coefficients += step
        return vector, coefficients

    start = torch.randn(dim, generator=generator).to(device, dtype)
    basis[0] = start / start.norm()
    for j in range(iterations):
        product = matmul(basis[j:j + 1])[0].to(dtype)
        scale = float(product.norm())
        product, coefficients = orthogonalize(product, j + 1)
        hessenberg[:j + 1, j] = coefficients.to(torch.float64).cpu()
        norm = float(product.norm())
        if j + 1 == iterations:
            break
        if norm <= breakdown * max(scale, 1e-30):  # invariant subspace: continue from a new random direction
            fresh = torch.randn(dim, generator=generator).to(device, dtype)
            fresh, _ = orthogonalize(fresh, j + 1)
            basis[j + 1] = fresh / fresh.norm()
        else:
            hessenberg[j + 1, j] = norm
            basis[j + 1] = product / norm
    projected = hessenberg[:iterations, :iterations]
    values, vectors = torch.linalg.eigh((projected + projected.t()) / 2)
    order = torch.argsort(values, descending=True)[:rank]
    eigenvectors = vectors[:, order].to(dtype).to(basis.device).t() @ basis[:iterations]  # [rank, dim]
    return values[order].clamp(min=0).to(dtype), eigenvectors


def conjugate_gradient(matmul: Callable[[Tensor], Tensor], rhs: Tensor, damping: float, *,
                       preconditioner: Tensor | None = None, tol: float = 1e-6,
                       max_iter: int = 1000) -> tuple[Tensor, int, Tensor]:
    """Solve ``(G + damping I) X^T = B^T`` for every row of ``rhs [K, P]`` at once (one batched product per
    iteration over the rows not yet converged).

    preconditioner: ``[P]`` positive diagonal ``M`` (``diag(G) + damping`` in the methods): preconditioned CG.
    tol: stop a row when ``|r| <= tol * |b|``.

    Returns:
        ``X [K, P]``, the iterations run, and the final relative residual of each row ``[K]``.
    """
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    rhs_norm = rhs.norm(dim=1).clamp(min=torch.finfo(rhs.dtype).tiny)
    inverse = None if preconditioner is None else 1.0 / preconditioner.to(rhs)
    precond = residual if inverse is None else residual * inverse
    direction = precond.clone()
    rho = (residual * precond).sum(1)
    active = torch.arange(rhs.shape[0], device=rhs.device)
    iterations = 0
    relative = residual.norm(dim=1) / rhs_norm
    while active.numel() and iterations < max_iter:
        live = relative[active] > tol
        active = active[live]
        if not active.numel():
            break
        iterations += 1
        p = direction[active]
        product = matmul(p).to(rhs) + damping * p
        alpha = rho[active] / (p * product).sum(1)
        solution[active] += alpha[:, None] * p
        residual[active] -= alpha[:, None] * product
        z = residual[active] if inverse is None else residual[active] * inverse
        rho_new = (residual[active] * z).sum(1)
        direction[active] = z + (rho_new / rho[active])[:, None] * p
        rho[active] = rho_new
        relative[active] = residual[active].norm(dim=1) / rhs_norm[active]
    return solution, iterations, relative
