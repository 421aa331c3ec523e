"""TRAK (Park et al. 2023): ``tau(q, i) = phi_q^T (Phi^T Phi + lambda I)^-1 phi_i (1 - p_i)``.

``phi`` are projected gradients of the model output function, ``Phi`` stacks the training examples' (``N x D``),
and ``p_i`` is the probability the model gives training example ``i``'s correct class. For a classifier TRAK's
output function is the margin ``f = log(p / (1 - p))``, whose gradient is ``-g / (1 - p)`` with ``g`` the gradient of
the cross-entropy loss that gradtrace stores. So, on stored loss gradients,

    phi_i = g_i / (1 - p_i)  (up to sign),   Phi^T Phi = sum_i g_i g_i^T / (1 - p_i)^2,
    tau(q, i) = (1 - p_q)^-1 * g_q^T (Phi^T Phi + lambda I)^-1 g_i.

The training side is the raw stored gradient; the ``1 - p`` reweighting lives in the kernel ``Phi^T Phi``, fitted in
one pass over the store (``D x D`` in the projected space) with ``p_i`` from one forward pass of the model over the
training data (the store does not keep losses): ``attr.fit(model, train_data, loss_fn)``. The query factor
``(1 - p_q)^-1`` is a positive constant per query: it changes no ranking and no LDS, and gradtrace omits it (scores
are in units of the loss gradient, like the other influence methods). For models that are not classifiers
(``causal_lm_loss``, ``regression_loss``, custom losses) there is no reweighting (``Q = I``): ``phi = g``.

Damping: ``damping * mean eigenvalue of Phi^T Phi`` (``damping_mode="relative"``, default 0.1, as the other
curvature methods) or ``damping`` as is. Positive = helpful. Ensembles over checkpoints / independently trained
models (TRAK averages ``tau`` over models): ``gradtrace.Attributor("trak", train=[store_1, ..., store_C])`` (a
:class:`gradtrace.Ensemble`) fits one kernel per member at its weights (``.fit(models=[...], data=..., loss_fn=...)``)
and combines the members' scores, each divided by its mean absolute value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.units import human_bytes
from ..curvature.curvature import CurvatureError
from ..curvature.hvp import loss_kind
from ..store.spec import GradientSpec, SpecMismatch
from .base import Method, MissingStage, register_method

__all__ = ["TRAK", "correct_class_complement"]


@torch.no_grad()
def correct_class_complement(model: torch.nn.Module, data: Any, loss_fn: Any, ids: list[str],
                             id_key: str = "id") -> Tensor:
    """``[N]``: ``1 - p_i`` of every training example in the order of ``ids`` (the store's), from one forward pass.

    ``p_i = exp(-loss_i)`` for the per-example cross-entropy ``loss_fn``; ``1 - p`` is computed as ``-expm1(-loss)``,
    so it keeps the loss's relative precision. A float32 loss cannot resolve ``1 - p`` below about ``|logit| *
    eps32`` (~1e-6): such confident examples get 0 there (and drop out of the kernel) unless the forward runs in
    float64. Batches that carry ids (``batch[id_key]``) are matched by id; otherwise the
    data must hold exactly the store's examples, in its order.
    """
    was_training = model.training
    model.eval()
    losses, seen = [], []
    try:
        for batch in data:
            if isinstance(batch, dict) and id_key in batch:
                batch_ids = batch[id_key]
                seen += [str(i) for i in (batch_ids.tolist() if isinstance(batch_ids, Tensor) else batch_ids)]
                batch = {k: v for k, v in batch.items() if k != id_key}
            losses.append(loss_fn(model, batch).detach().to(torch.float64).cpu())
    finally:
        model.train(was_training)
    loss = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
    complement = -torch.expm1(-loss)
    if seen:
        if len(seen) != len(loss):
            raise ValueError("trak: some batches of the data carry ids and others do not")
        row = {ident: i for i, ident in enumerate(seen)}
        missing = [ident for ident in ids if ident not in row]
        if missing:
            raise ValueError(f"trak: the data given to fit() lacks {len(missing)} training examples of the store "
                             f"(e.g. {missing[:3]}); pass the training data the store was collected from")
        return complement[torch.tensor([row[ident] for ident in ids], dtype=torch.long)]
    if len(loss) != len(ids):
        raise ValueError(f"trak: the data given to fit() has {len(loss)} examples, the store {len(ids)}; pass the "
                         "training data the store was collected from (with an 'id' column to match by id)")
    return complement


@register_method
class TRAK(Method):
    """TRAK influence (see the module docstring).

    damping, damping_mode: as the other curvature methods (relative to the mean eigenvalue of ``Phi^T Phi``).
    reweight: ``"auto"`` (the ``1 - p`` weights for :func:`~gradtrace.losses.classification_loss`, none for other
        losses), True (require them) or False (``Phi`` = the stored gradients; ``attr.fit()`` needs no model).
    max_dim: refuse gradients of more dimensions (the kernel is ``D x D``): project them (``gradtrace.LoGra``).
    """

    name = "trak"
    needs = ("kernel",)
    description = "TRAK: projected features, (Phi^T Phi + lambda I)^-1 on the query side, 1 - p weights (classifiers)"

    def __init__(self, damping: float = 0.1, damping_mode: str = "relative", reweight: bool | str = "auto",
                 max_dim: int = 32768) -> None:
        if damping_mode not in ("relative", "absolute"):
            raise ValueError(f"damping_mode must be 'relative' or 'absolute', got {damping_mode!r}")
        if damping < 0:
            raise ValueError("damping must be >= 0")
        if reweight not in ("auto", True, False):
            raise ValueError(f"reweight must be 'auto', True or False, got {reweight!r}")
        self.damping, self.damping_mode, self.reweight, self.max_dim = damping, damping_mode, reweight, max_dim
        self.values: Tensor | None = None
        self.vectors: Tensor | None = None
        self.spec: GradientSpec | None = None
        self.reweighted: bool | None = None
        self.examples = 0

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None) -> None:
        """Accumulate ``Phi^T Phi`` from the training store (one pass) and eigendecompose it (float64, kept)."""
        spec = attributor.spec
        dim = spec.dim
        if dim > self.max_dim:
            raise CurvatureError(f"trak: the kernel of {dim:,}-dimensional gradients takes {dim:,}^2 x 8 bytes = "
                                 f"{human_bytes(8 * dim * dim)} (float64), beyond max_dim={self.max_dim:,}; collect "
                                 "projected gradients (projection=gradtrace.LoGra(rank=...)) or raise max_dim=")
        source = attributor.train[0]
        weights = self._weights(source, model, data, loss_fn)
        kernel = torch.zeros(dim, dim, dtype=torch.float64, device=attributor.device)
        for offset, block in source.iter_blocks(attributor.block_rows, attributor.device):
            block = block.to(torch.float64)
            if weights is not None:
                block = block / weights[offset:offset + block.shape[0]].to(block.device)[:, None]
            kernel += block.t() @ block
        if len(source) == 0:
            raise ValueError("trak: the training store is empty")
        values, self.vectors = torch.linalg.eigh(kernel)  # kept in float64: D x D, small in the projected space
        self.values = values.clamp(min=0)
        self.spec, self.examples = spec, len(source)

    def _weights(self, source: Any, model: Any, data: Any, loss_fn: Any) -> Tensor | None:
        """``1 - p_i`` per stored row (None: no reweighting)."""
        if self.reweight is False:
            self.reweighted = False
            return None
        if model is None or data is None:
            raise MissingStage("trak: the 1 - p weights of a classifier need attr.fit(model, train_data, loss_fn) "
                               "(one forward pass); for other models, or to fit from the store alone, pass "
                               "Attributor('trak', ..., reweight=False)")
        if iter(data) is data:
            data = list(data)
        first = next(iter(data), None)
        if first is None:
            raise ValueError("trak: the training data is empty")
        kind = loss_kind(loss_fn, first)
        if kind != "cls":
            if self.reweight is True:
                raise ValueError("trak: the 1 - p weights are defined for classifiers (gradtrace.losses."
                                 f"classification_loss); this loss is {kind!r}: use reweight='auto' or False")
            self.reweighted = False
            return None
        from ..losses import classification_loss

        complement = correct_class_complement(model, data, loss_fn or classification_loss, list(source.ids))
        # 1 - p == 0 only when the loss underflows to 0, where the gradient is 0 too: that row contributes nothing
        self.reweighted = True
        return torch.where(complement > 0, complement, torch.full_like(complement, float("inf")))

    @property
    def lam(self) -> float:
        if self.damping_mode == "absolute":
            return self.damping
        return self.damping * float(self.values.mean())

    def check_ready(self) -> None:
        if self.values is None:
            raise MissingStage("trak needs its kernel: run attr.fit(model, train_data, loss_fn) first (or attr.fit() "
                               "with reweight=False)")

    def bind(self, spec: GradientSpec) -> None:
        self.check_ready()
        if spec.params != self.spec.params or spec.projection != self.spec.projection:
            raise SpecMismatch("trak: the kernel was fitted for other gradients (parameters or projection differ); "
                               "fit it on these")

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        """``(Phi^T Phi + lambda I)^-1 g_q`` in the float64 eigenbasis."""
        self.check_ready()
        lam = self.lam
        if float(self.values.min()) + lam <= 0:
            raise CurvatureError("trak: the kernel Phi^T Phi is singular (fewer examples than dimensions?) and "
                                 f"damping is {lam:g}; use damping > 0")
        vectors = self.vectors.to(queries.device)
        rotated = queries.to(torch.float64) @ vectors
        return ((rotated / (self.values.to(queries.device) + lam)) @ vectors.t()).to(torch.float32)

    def fit_state(self, path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The kernel's float64 eigendata; damping, reweighting and the gradients' spec (see
        :mod:`gradtrace.methods.saved`)."""
        fields = {"damping": self.damping, "damping_mode": self.damping_mode, "reweight": self.reweight,
                  "reweighted": self.reweighted, "examples": self.examples, "max_dim": self.max_dim,
                  "spec": self.spec.to_dict()}
        return fields, {"values": self.values, "vectors": self.vectors}

    @classmethod
    def from_fit_state(cls, fields: dict[str, Any], tensors: dict[str, Tensor], spec: GradientSpec, path: Path,
                       damping: float | None = None, damping_mode: str | None = None) -> TRAK:
        """A saved kernel (``damping`` / ``damping_mode``: other than the saved ones, no refit needed)."""
        from .saved import FitError, check_tensor, refuse_unused

        try:
            method = cls(damping=fields["damping"] if damping is None else damping,
                         damping_mode=fields["damping_mode"] if damping_mode is None else damping_mode,
                         reweight=fields["reweight"], max_dim=int(fields["max_dim"]))
            reweighted, examples = fields["reweighted"], int(fields["examples"])
        except KeyError as err:
            raise FitError(f"{path / 'fit.json'} lacks {err}; fit again") from None
        dim = spec.dim
        method.values = check_tensor(tensors, "values", (dim,), torch.float64, path)
        method.vectors = check_tensor(tensors, "vectors", (dim, dim), torch.float64, path)
        refuse_unused(tensors, {"values", "vectors"}, path)
        method.spec, method.reweighted, method.examples = spec, reweighted, examples
        return method

    def options(self) -> dict[str, Any]:
        return {"damping": self.damping, "damping_mode": self.damping_mode, "reweight": self.reweight,
                "reweighted": self.reweighted, "examples": self.examples,
                "lambda": None if self.values is None else self.lam}
