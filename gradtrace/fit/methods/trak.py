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
models (TRAK averages ``tau`` over models): ``gradtrace.Ensemble("trak", train=[store_1, ..., store_C])`` fits
one kernel per member at its weights (``.fit(models=[...], data=..., loss_fn=...)``) and combines the members'
scores, each divided by its mean absolute value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...common.checks import at_least, count
from ...common.units import human_bytes
from ...store.spec import GradientSpec, SpecMismatch
from ..curvature.curvature import CurvatureError
from ..curvature.hvp import loss_kind
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
    reweight: ``"auto"`` (the ``1 - p`` weights for :func:`~gradtrace.loss.classification_loss`, none for other
        losses), True (require them) or False (``Phi`` = the stored gradients; ``attr.fit()`` needs no model).
    mode: ``"primal"`` -- the ``D x D`` kernel ``Phi^T Phi``, eigendecomposed; ``"dual"`` -- the ``N x N`` Gram
        matrix ``Phi Phi^T`` instead, with ``(Phi^T Phi + lambda I)^-1 = (I - Phi^T (Phi Phi^T + lambda I)^-1 Phi) /
        lambda`` (Woodbury): the same scores, for stores with fewer examples than dimensions (a LoGra store of a
        large model), at the price of two passes over the training rows per query set (the fit keeps a reference
        to them); ``"auto"`` (default): ``"dual"`` when ``N < D``, else ``"primal"``. :attr:`mode_used` says which.
    max_dim: refuse a kernel (primal: ``D``; dual: ``N``) beyond this size (it is ``max_dim^2`` float64 values).
    """

    name = "trak"
    needs = ("kernel",)
    description = "TRAK: projected features, (Phi^T Phi + lambda I)^-1 on the query side, 1 - p weights (classifiers)"

    def __init__(self, damping: float = 0.1, damping_mode: str = "relative", reweight: bool | str = "auto",
                 max_dim: int = 32768, mode: str = "auto") -> None:
        if damping_mode not in ("relative", "absolute"):
            raise ValueError(f"damping_mode must be 'relative' or 'absolute', got {damping_mode!r}")
        at_least(damping, "damping", 0)
        count(max_dim, "max_dim")
        if reweight not in ("auto", True, False):
            raise ValueError(f"reweight must be 'auto', True or False, got {reweight!r}")
        if mode not in ("auto", "primal", "dual"):
            raise ValueError(f"trak mode must be 'auto', 'primal' or 'dual', got {mode!r}")
        self.damping, self.damping_mode, self.reweight, self.max_dim = damping, damping_mode, reweight, max_dim
        self.mode = mode
        self.mode_used: str | None = None
        self.values: Tensor | None = None  # eigenvalues of Phi^T Phi (primal) or of Phi Phi^T (dual), float64
        self.vectors: Tensor | None = None
        self.spec: GradientSpec | None = None
        self.reweighted: bool | None = None
        self.examples = 0
        self.trace = 0.0  # trace of Phi^T Phi (= of Phi Phi^T): the mean eigenvalue is trace / D
        self.rows: Any = None  # dual: the training rows Phi is made of (a store or gradient set)
        self.row_weights: Tensor | None = None  # dual, reweighted: 1 - p per row (inf: a row that drops out)
        self.block_rows, self.device = 8192, torch.device("cpu")

    def fit(self, attributor: Any, model: Any = None, data: Any = None, loss_fn: Any = None) -> None:
        """Accumulate ``Phi^T Phi`` (primal) or ``Phi Phi^T`` (dual) from the training store and eigendecompose it
        (float64, kept)."""
        spec, source = attributor.spec, attributor.train[0]
        if len(source) == 0:
            raise ValueError("trak: the training store is empty")
        mode = self.mode if self.mode != "auto" else ("dual" if len(source) < spec.dim else "primal")
        size = spec.dim if mode == "primal" else len(source)
        if size > self.max_dim:
            what = (f"the kernel of {size:,}-dimensional gradients" if mode == "primal" else
                    f"the Gram matrix of {size:,} training examples")
            fix = ("collect projected gradients (options=CaptureOptions(projection=gradtrace.LoGra(rank=...))), use "
                   "mode='dual' when there are fewer examples than dimensions," if mode == "primal" else
                   "use mode='primal' with projected gradients of fewer dimensions,")
            raise CurvatureError(f"trak: {what} takes {size:,}^2 x 8 bytes = {human_bytes(8 * size * size)} "
                                 f"(float64), beyond max_dim={self.max_dim:,}; {fix} or raise max_dim=")
        weights = self._weights(source, model, data, loss_fn)
        self.block_rows, self.device = attributor.block_rows, attributor.device
        if mode == "primal":
            kernel = torch.zeros(spec.dim, spec.dim, dtype=torch.float64, device=attributor.device)
            for offset, block in source.iter_blocks(attributor.block_rows, attributor.device):
                block = _features(block, weights, offset)
                kernel += block.t() @ block
            self.rows, self.row_weights = None, None
        else:
            kernel = _gram(source, weights, attributor.block_rows, attributor.device)
            self.rows, self.row_weights = source, weights
        self.trace = float(kernel.diagonal().sum())
        values, vectors = torch.linalg.eigh(kernel)  # kept in float64: small in the projected space
        del kernel
        # row-major as a saved-then-loaded copy is: the same BLAS paths before and after a load, no copy at save
        self.values, self.vectors = values.clamp(min=0), vectors.contiguous()
        self.spec, self.examples, self.mode_used = spec, len(source), mode

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
                raise ValueError("trak: the 1 - p weights are defined for classifiers (gradtrace.loss.functions."
                                 f"classification_loss); this loss is {kind!r}: use reweight='auto' or False")
            self.reweighted = False
            return None
        from ...loss.functions import classification_loss

        complement = correct_class_complement(model, data, loss_fn or classification_loss, list(source.ids))
        # 1 - p == 0 only when the loss underflows to 0, where the gradient is 0 too: that row contributes nothing
        self.reweighted = True
        return torch.where(complement > 0, complement, torch.full_like(complement, float("inf")))

    @property
    def lam(self) -> float:
        if self.damping_mode == "absolute":
            return self.damping
        if self.mode_used == "dual":  # the mean of Phi^T Phi's D eigenvalues, N of which are Phi Phi^T's
            return self.damping * self.trace / self.spec.dim
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
        """``(Phi^T Phi + lambda I)^-1 g_q`` in float64: in the kernel's eigenbasis (primal), or by Woodbury from the
        Gram matrix's with two passes over the training rows (dual)."""
        self.check_ready()
        lam = self.lam
        if self.mode_used == "dual":
            return self._prepare_dual(queries, lam)
        if float(self.values.min()) + lam <= 0:
            raise CurvatureError("trak: the kernel Phi^T Phi is singular (fewer examples than dimensions?) and "
                                 f"damping is {lam:g}; use damping > 0")
        vectors = self.vectors.to(queries.device)
        rotated = queries.to(torch.float64) @ vectors
        return ((rotated / (self.values.to(queries.device) + lam)) @ vectors.t()).to(torch.float32)

    def _prepare_dual(self, queries: Tensor, lam: float) -> Tensor:
        """``(g - Phi^T (Phi Phi^T + lambda I)^-1 Phi g) / lambda``: ``A = G_q Phi^T`` (one pass over the rows),
        ``B = A (Phi Phi^T + lambda I)^-1`` (the Gram's eigenbasis), ``C = B Phi`` (a second pass)."""
        if lam <= 0:
            raise CurvatureError("trak: with fewer examples than dimensions the kernel Phi^T Phi is singular, and "
                                 f"damping is {lam:g}; use damping > 0")
        if self.rows is None:
            raise MissingStage("trak: this dual fit has no training rows attached; load it with "
                               "gradtrace.load_fit(path, store=...)")
        device = queries.device
        wanted = queries.to(torch.float64)
        products = torch.zeros(wanted.shape[0], self.examples, dtype=torch.float64, device=device)
        for offset, block in self.rows.iter_blocks(self.block_rows, device):
            products[:, offset:offset + block.shape[0]] = wanted @ _features(block, self.row_weights, offset).t()
        vectors = self.vectors.to(device)
        solved = ((products @ vectors) / (self.values.to(device) + lam)) @ vectors.t()
        back = torch.zeros_like(wanted)
        for offset, block in self.rows.iter_blocks(self.block_rows, device):
            back += solved[:, offset:offset + block.shape[0]] @ _features(block, self.row_weights, offset)
        return ((wanted - back) / lam).to(torch.float32)

    def fit_state(self, path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The kernel's (primal) or Gram matrix's (dual) float64 eigendata; damping, reweighting, the gradients'
        spec, and for a dual fit the store it reads (path and fingerprint; see :mod:`gradtrace.fit.methods.saved`)."""
        fields = {"damping": self.damping, "damping_mode": self.damping_mode, "reweight": self.reweight,
                  "reweighted": self.reweighted, "examples": self.examples, "max_dim": self.max_dim,
                  "mode": self.mode, "mode_used": self.mode_used, "trace": self.trace, "spec": self.spec.to_dict()}
        tensors = {"values": self.values, "vectors": self.vectors}
        if self.mode_used == "dual":
            fields["rows"] = _store_reference(self.rows, path)
            if self.row_weights is not None:
                tensors["row_weights"] = self.row_weights.to(torch.float64)
        return fields, tensors

    @classmethod
    def from_fit_state(cls, fields: dict[str, Any], tensors: dict[str, Tensor], spec: GradientSpec, path: Path,
                       damping: float | None = None, damping_mode: str | None = None, store: Any = None) -> TRAK:
        """A saved fit (``damping`` / ``damping_mode``: other than the saved ones, no refit needed; ``store``: the
        training rows a dual fit reads, when not where it was saved from)."""
        from .saved import FitError, check_tensor, refuse_unused

        try:
            method = cls(damping=fields["damping"] if damping is None else damping,
                         damping_mode=fields["damping_mode"] if damping_mode is None else damping_mode,
                         reweight=fields["reweight"], max_dim=int(fields["max_dim"]),
                         mode=fields.get("mode", "primal"))
            reweighted, examples = fields["reweighted"], int(fields["examples"])
            mode_used = fields.get("mode_used", "primal")
        except KeyError as err:
            raise FitError(f"{path / 'fit.json'} lacks {err}; fit again") from None
        size = spec.dim if mode_used == "primal" else examples
        method.values = check_tensor(tensors, "values", (size,), torch.float64, path)
        method.vectors = check_tensor(tensors, "vectors", (size, size), torch.float64, path)
        used = {"values", "vectors"}
        if mode_used == "dual":
            method.rows = _open_reference(fields.get("rows"), path, spec, examples, store)
            if "row_weights" in tensors:
                method.row_weights = check_tensor(tensors, "row_weights", (examples,), torch.float64, path)
                used.add("row_weights")
        refuse_unused(tensors, used, path)
        method.trace = float(fields.get("trace") or method.values.sum())
        method.spec, method.reweighted, method.examples, method.mode_used = spec, reweighted, examples, mode_used
        return method

    def options(self) -> dict[str, Any]:
        return {"damping": self.damping, "damping_mode": self.damping_mode, "reweight": self.reweight,
                "reweighted": self.reweighted, "examples": self.examples, "mode": self.mode,
                "mode_used": self.mode_used, "lambda": None if self.values is None else self.lam}


def _features(block: Tensor, weights: Tensor | None, offset: int) -> Tensor:
    """Rows of ``Phi``: the stored gradients in float64, divided by their ``1 - p`` when reweighted."""
    block = block.to(torch.float64)
    if weights is None:
        return block
    return block / weights[offset:offset + block.shape[0]].to(block.device)[:, None]


def _gram(source: Any, weights: Tensor | None, block_rows: int, device: Any) -> Tensor:
    """``Phi Phi^T`` (``N x N`` float64), block pair by block pair: each block is read once as the left side and
    once per earlier block as the right (``b (b + 1) / 2`` block reads for ``b`` blocks), never all rows at once."""
    count = len(source)
    gram = torch.zeros(count, count, dtype=torch.float64, device=device)
    for left_at, left in source.iter_blocks(block_rows, device):
        left = _features(left, weights, left_at)
        stop = left_at + left.shape[0]
        gram[left_at:stop, left_at:stop] = left @ left.t()
        for right_at in range(stop, count, block_rows):
            right_stop = min(count, right_at + block_rows)
            right = _features(source.read(right_at, right_stop, device), weights, right_at)
            part = left @ right.t()
            gram[left_at:stop, right_at:right_stop] = part
            gram[right_at:right_stop, left_at:stop] = part.t()
    return gram


def _store_reference(rows: Any, path: Path) -> dict[str, Any]:
    """What a saved dual fit records of the store it reads: its path (relative to the fit and absolute) and its
    fingerprint's digest. Rows held in memory cannot be referenced: refused."""
    from ...common.provenance import relative_path
    from ...store import GradientStore
    from ...store.fingerprint import store_fingerprint

    if not isinstance(rows, GradientStore):
        raise TypeError("trak: a dual fit reads its training rows at every scoring, and these are held in memory "
                        f"({type(rows).__name__}); fit it on a GradientStore on disk to save it, or use mode='primal'")
    root = Path(rows.root).absolute()
    return {"path": relative_path(str(root), str(Path(path).absolute())), "absolute": str(root),
            "digest": store_fingerprint(rows)["digest"]}


def _open_reference(reference: Any, path: Path, spec: GradientSpec, examples: int, store: Any) -> Any:
    """The store a saved dual fit reads: ``store`` when given, else the recorded one (relative to the fit first,
    then absolute); refused unless its fingerprint is the recorded one."""
    from ...store import GradientStore
    from ...store.fingerprint import store_fingerprint
    from .saved import FitError

    if not isinstance(reference, dict) or "digest" not in reference:
        raise FitError(f"{path / 'fit.json'} is a dual trak fit that records no store; fit again")
    if store is None:
        candidates = [Path(path) / reference.get("path", ""), Path(reference.get("absolute", ""))]
        found = next((c for c in candidates if (c / "manifest.json").is_file()), None)
        if found is None:
            raise FitError(f"{path}: this dual trak fit reads the training rows of store {reference.get('absolute')}, "
                           "which is not there (nor at its place relative to the fit); pass the store: "
                           "gradtrace.load_fit(path, store=...)")
        store = GradientStore.open(found)
    elif not isinstance(store, GradientStore):
        store = GradientStore.open(store)
    if store_fingerprint(store)["digest"] != reference["digest"]:
        raise FitError(f"{path}: store {store.root} is not the one this dual trak fit was made from (or changed "
                       "since): fit it again on the store you score")
    if len(store) != examples or store.spec.dim != spec.dim:
        raise FitError(f"{path}: store {store.root} holds {len(store)} rows of {store.spec.dim} dims, the fit "
                       f"{examples} of {spec.dim}; fit again")
    return store
