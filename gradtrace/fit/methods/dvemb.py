"""DVEmb -- data value embeddings (Wang et al. 2024): trajectory-specific leave-one-out for SGD training.

Removing example ``z`` from step ``s`` of an SGD run ``theta_{t+1} = theta_t - sum_{rows of B_t} w g_t`` moves
``theta_{s+1}`` by ``+w_s g_s(z)``. Propagating that through the later steps, linearised with the batch's
empirical Fisher ``H_t = sum_{rows of B_t} w g_t g_t^T`` (the step sizes ``w`` folded in), changes the final
query loss by::

    Delta L_q ~= g_q(theta_T)^T (I - H_{T-1}) ... (I - H_{s+1}) w_s g_s(z) = g_q(theta_T)^T DVEmb_s(z)

The embedding of ``z`` sums ``DVEmb_s(z)`` over every step it was used in, and is computed for all examples
at once by one backward pass over the recorded trajectory (``M`` is ``p x p``, ``I - M`` the product of the
later factors)::

    M <- 0
    for t = T-1 ... 0:   D_t = W_t (G_t - G_t M^T);   E[rows of B_t] += D_t;   M += D_t^T G_t

``score(q, z) = E[z] . g_q(theta_T)``: positive = removing ``z`` would raise the query loss (``z`` helps), in
units of query loss. The trajectory is recorded by :class:`gradtrace.train.TrajectoryWriter` (per-row fields
``example``, ``step``, ``weight``); queries are collected at the final weights with the same projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...capture.gradient_set import GradientSet
from ...common.checks import count
from ...store.spec import GradientSpec
from .base import Method, MissingStage, register_method

__all__ = ["DVEmb", "data_value_embeddings"]

REQUIRED_FIELDS = ("example", "step", "weight")


def _field(source: Any, name: str) -> list[Any]:
    values = source.field(name) if hasattr(source, "field") else [None] * len(source)
    if len(values) != len(source) or any(v is None for v in values):
        raise MissingStage(f"dvemb needs the per-row field {name!r} (and {', '.join(REQUIRED_FIELDS)}) of a training "
                           "trajectory, which these training gradients lack: record the trajectory during training "
                           "with gradtrace.train.TrajectoryWriter(path, optimizer) as a capture callback")
    return list(values)


def _rows(source: Any, index: list[int], device: torch.device) -> Tensor:
    """Rows ``index`` of a store or gradient set as float32 ``[len(index), dim]``."""
    if index == list(range(index[0], index[0] + len(index))):
        return source.read(index[0], index[0] + len(index), device)
    if hasattr(source, "rows"):
        return source.rows(index, device)
    return source.read(0, len(source))[torch.tensor(index)].to(device)


def _dtype(value: torch.dtype | str) -> torch.dtype:
    dtype = getattr(torch, value) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"precision must be float32 or float64, got {value!r}")
    return dtype


def data_value_embeddings(trajectory: Any, *, by: str = "example", max_dim: int = 8192,
                          precision: torch.dtype | str = torch.float64, device: torch.device | str | None = None,
                          block_rows: int = 512, progress: bool = False) -> GradientSet:
    """Data value embeddings from a recorded trajectory (one backward pass over its steps).

    Args:
        trajectory: a store or :class:`~gradtrace.GradientSet` written by
            :class:`gradtrace.train.TrajectoryWriter` (rows with fields ``example``, ``step``, ``weight``).
        by: ``"example"``: one embedding per distinct example (summed over the steps it was used in);
            ``"row"``: one per trajectory row (the effect of removing that example from that step only).
        max_dim: refuse gradients of more dims than this (``M`` is ``dim x dim``).
        precision: dtype of ``M`` and of the per-step products (float64 by default); embeddings are float32.
        device: where the recursion runs.
        block_rows: trajectory rows processed per block of steps (speed only; the result does not depend on it).

    Returns a :class:`~gradtrace.GradientSet` with the trajectory's parameters and projection (queries taken with
    the same projection are comparable) and ``convention["features"] == "dvemb"``; ``.save(path)`` stores it.
    """
    if by not in ("example", "row"):
        raise ValueError(f"by must be 'example' or 'row', got {by!r}")
    count(block_rows, "block_rows")
    count(max_dim, "max_dim")
    spec: GradientSpec = trajectory.spec
    dim = spec.dim
    dtype = _dtype(precision)
    if dim > max_dim:
        gib = dim * dim * torch.finfo(dtype).bits / 8 / 2**30
        raise ValueError(f"dvemb keeps a dim x dim matrix, and these gradients have {dim} dims ({gib:.1f} GiB in "
                         f"{dtype}): record the trajectory with a smaller LoGra rank (e.g. LoGra(rank=8)) or fewer "
                         f"layers (capture(..., options=CaptureOptions(layers=[...]))), or raise max_dim={max_dim}")
    if len(trajectory) == 0:
        raise ValueError("the trajectory is empty")
    examples = [str(e) for e in _field(trajectory, "example")]
    steps = [int(s) for s in _field(trajectory, "step")]
    weights = torch.tensor([float(w) for w in _field(trajectory, "weight")], dtype=torch.float64)
    if not bool(torch.isfinite(weights).all()):
        raise ValueError("the trajectory's 'weight' field holds non-finite step sizes")
    device = torch.device(device) if device is not None else torch.device("cpu")
    by_step: dict[int, list[int]] = {}
    for row, step in enumerate(steps):
        by_step.setdefault(step, []).append(row)
    if by == "example":
        ids = list(dict.fromkeys(examples))
        slot = {ident: k for k, ident in enumerate(ids)}
        target = torch.tensor([slot[e] for e in examples], dtype=torch.long)
    else:
        ids = list(trajectory.ids)
        target = torch.arange(len(examples))
    embeddings = torch.zeros(len(ids), dim, dtype=torch.float32, device=device)
    memory = torch.zeros(dim, dim, dtype=dtype, device=device)  # M: I - M = product of the later (I - H_t)
    # Steps are processed in blocks of about ``block_rows`` rows: M is read once per block (one large product
    # G_block M^T) and updated once (a rank-R update); within a block, the later steps' corrections from the
    # block's earlier steps come from the block's small Gram matrix. Same result as one step at a time.
    blocks: list[list[int]] = []
    filled = 0
    for step in sorted(by_step, reverse=True):
        if not blocks or filled + len(by_step[step]) > block_rows:
            blocks.append([])
            filled = 0
        blocks[-1].append(step)
        filled += len(by_step[step])
    bar = None
    if progress:
        from ...common.progress import progress_bar

        bar = progress_bar(total=len(by_step), desc="dvemb", unit="step")
    for block in blocks:
        rows = [r for s in block for r in by_step[s]]
        grads = _rows(trajectory, rows, device).to(dtype)  # G of the block's steps [R, dim]
        step_sizes = weights[rows].to(device, dtype).unsqueeze(1)  # W [R, 1]
        base = grads @ memory.t()  # G_t M^T with M as of the block's start
        gram = grads @ grads.t()  # [R, R]
        updates = torch.empty_like(grads)  # D_t of each step, stacked
        start = 0
        for step in block:
            stop = start + len(by_step[step])
            applied = base[start:stop]
            if start:  # M has grown by D^T G of the block's earlier (later-in-training) steps
                applied = applied + gram[start:stop, :start] @ updates[:start]
            updates[start:stop] = (grads[start:stop] - applied) * step_sizes[start:stop]  # W_t (G_t - G_t M^T)
            start = stop
        embeddings.index_add_(0, target[rows].to(device), updates.to(torch.float32))
        memory.addmm_(updates.t(), grads)  # M += D^T G
        if bar is not None:
            bar.update(len(block))
    if bar is not None:
        bar.close()
    convention = {**spec.convention, "features": "dvemb"}
    out_spec = GradientSpec(spec.params, spec.projection, convention, spec.model, "float32")
    if by == "example":
        counts: dict[str, list[int]] = {}
        for example, step in zip(examples, steps):
            counts.setdefault(example, []).append(step)
        fields = {"rows": [len(counts[i]) for i in ids], "first_step": [min(counts[i]) for i in ids],
                  "last_step": [max(counts[i]) for i in ids]}
    else:
        fields = {"example": examples, "step": steps}
    return GradientSet(embeddings.cpu(), ids, out_spec, fields=fields)


@register_method
class DVEmb(Method):
    """``tau(q, z) = E[z] . g_q(theta_T)``: predicted rise of the query loss if ``z`` were left out of training.

    ``Attributor("dvemb", trajectory).fit()`` computes the embeddings (:attr:`embeddings`) from the trajectory and
    scores against them from then on; ``Attributor("dvemb", saved_embeddings)`` scores saved ones directly.
    """

    name = "dvemb"
    needs = ("embeddings",)
    description = "data value embeddings: trajectory-specific leave-one-out of SGD training (positive = helpful)"

    def __init__(self, max_dim: int = 8192, precision: str = "float64") -> None:
        self.max_dim = count(max_dim, "max_dim")
        self.precision = precision
        _dtype(precision)
        self.embeddings: GradientSet | None = None

    def fit(self, attributor: Any, progress: bool = False, block_rows: int = 512) -> None:
        """Compute the embeddings from the attributor's training trajectory and score against them."""
        if len(attributor.train) != 1:
            raise ValueError("dvemb reads one trajectory store")
        source = attributor.train[0]
        if source.spec.convention.get("features") == "dvemb":
            raise ValueError("dvemb: the training gradients already are data value embeddings; score them directly")
        self.embeddings = data_value_embeddings(source, max_dim=self.max_dim, precision=self.precision,
                                                device=attributor.device, block_rows=block_rows, progress=progress)
        attributor.train = [self.embeddings]

    def bind(self, spec: GradientSpec) -> None:
        if spec.convention.get("features") != "dvemb":
            raise MissingStage("dvemb scores data value embeddings: run attr.fit() on the training trajectory "
                               "(recorded with gradtrace.train.TrajectoryWriter) first, or pass embeddings saved with "
                               "attr.method.embeddings.save(path)")

    def options(self) -> dict[str, Any]:
        return {"max_dim": self.max_dim, "precision": self.precision}

