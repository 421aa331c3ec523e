"""Consistency check: per-example gradients, with their loss scale put back, sum to autograd's gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from ..grad.batch import GradientBatch
from ..grad.terms import OuterTerm, VectorTerm, is_index
from ..projection.logra import Projector

__all__ = ["check_batch_sum"]


def _token_norms(term, inverse: Tensor) -> Tensor:
    """``sum_e inverse_e * sum_t ||token contribution_t||`` of a term."""
    if isinstance(term, OuterTerm):
        def norm(f: Tensor) -> Tensor:
            return f.to(torch.float32).norm(dim=-1) if not is_index(f) else (f >= 0).to(torch.float32)

        per_token = norm(term.rows) * norm(term.cols)
    elif isinstance(term, VectorTerm):
        per_token = term.values.to(torch.float32).norm(dim=-1)
    else:
        per_token = term.values.to(torch.float32).reshape(term.num_examples, 1, -1).norm(dim=-1)
    return (per_token.sum(1) * inverse).sum()


def check_batch_sum(batch: GradientBatch, param_grads: dict[str, Tensor], projector: Projector | None,
                    rtol: float | None = None, handlers: list | None = None) -> list[str]:
    """Compare ``sum_e g_e / scale_e`` with the batch gradient of each parameter; return the mismatches.

    handlers: the capture's layer handlers; one with its own ``project_full`` (an experts layer projects each
    expert's block) projects its parameters' batch gradients, the projector the others."""
    own = {name: h for h in handlers or () if hasattr(h, "project_full") for name in h.params.values()}
    problems = []
    inverse = torch.where(batch.scale > 0, 1.0 / batch.scale.clamp(min=1e-30), torch.zeros_like(batch.scale))
    for name, pg in batch.params.items():
        if name not in param_grads:
            continue
        full = param_grads[name]
        tol = rtol if rtol is not None else (1e-3 if full.dtype == torch.float32 else 5e-2)
        contributions = pg.flat() * inverse.to(full.device).unsqueeze(1)
        total = contributions.sum(0)
        if projector is None:
            expected = full.to(torch.float32)
        elif name in own:
            expected = own[name].project_full(projector, name, full[None], tuple(full.shape))
        else:
            expected = projector.project_full(name, full[None], tuple(full.shape))
        expected = expected.reshape(-1)
        # relative to the size of what is summed (token by token), so gradients that cancel to ~0 are
        # judged by the rounding error they can carry
        summed = sum(_token_norms(t, inverse.to(full.device)) for t in pg.terms)
        magnitude = torch.maximum(expected.norm(), summed).clamp(min=1e-12)
        err = (total - expected).norm() / magnitude
        if err > tol:
            problems.append(f"{name}: relative error {float(err):.2e}")
    return problems
