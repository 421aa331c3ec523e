"""Preference losses per pair: DPO and the variants TRL's ``DPOTrainer`` offers, computed as it computes them.

A preference example is a *pair*: a prompt with a chosen and a rejected completion. Its loss compares how much
more likely the policy makes each completion than a frozen reference model does::

    chosen_logratio   = log pi(chosen | prompt)   - log ref(chosen | prompt)      (summed over completion tokens)
    rejected_logratio = log pi(rejected | prompt) - log ref(rejected | prompt)
    sigmoid (DPO):  -log sigmoid(beta * (chosen_logratio - rejected_logratio))

and the other types of :data:`PAIR_LOSSES` (IPO, hinge, robust, ...; see :class:`DPO`), as
``trl.trainer.dpo_trainer.DPOTrainer._compute_loss`` computes them for ``trl`` 1.x -- the tests check the
gradients against autograd of that very method. The reference log-probabilities are computed once, before any
gradient (:func:`reference_logps`; ``gradtrace.data.PreferenceDataset.with_reference``), or read from the
``ref_chosen_logps`` / ``ref_rejected_logps`` columns TRL's ``precompute_ref_log_probs`` stores.

:class:`DPOLoss` is the per-example loss of :func:`gradtrace.collect` for such pairs: it runs the chosen and
rejected rows through the model in one forward call (as TRL's concatenated forward does) and tells the capture,
through :meth:`DPOLoss.capture_info`, that rows ``i`` and ``P + i`` are one example (``row_examples``), so each
pair gets one gradient: the sum of its two rows' terms, the gradient of the pair's own loss.

Batches (:func:`gradtrace.data.load_preference` makes them) hold, for ``P`` pairs, ``chosen_input_ids``,
``chosen_attention_mask``, ``chosen_labels`` (``-100`` outside the completion) and the same three ``rejected_*``
tensors (each ``[P, T]``), and ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[P]``.

This module imports nothing else of gradtrace but :mod:`.functions`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functions import token_cross_entropy

__all__ = ["BATCH_LOSSES", "DPO", "DPOLoss", "F_DIVERGENCES", "PAIR_LOSSES", "REFERENCE_KEYS", "pair_rows",
           "reference_logps", "sequence_logps"]

PAIR_LOSSES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                                "apo_zero", "apo_down", "discopop", "sigmoid_norm")
"""TRL's DPO loss types whose loss for a pair depends on that pair alone (each is supported)."""

BATCH_LOSSES: dict[str, str] = {
    "aot": "sorts the log-ratios across the batch, so a pair's loss depends on the other pairs of its batch",
    "aot_unpaired": "sorts the log-ratios across the batch, so a pair's loss depends on the other pairs of its batch",
    "sft": "is the mean over every chosen token of the batch, so a pair's share depends on the other pairs' lengths",
}
"""TRL's loss types that couple the pairs of a batch (refused, with the reason): no per-pair gradient exists."""

F_DIVERGENCES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
"""TRL's ``f_divergence_type`` values (``reverse_kl``: standard DPO)."""

REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""The batch keys (and dataset columns, TRL's names) of the reference model's summed log-probabilities."""

_ROW_KEYS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True, kw_only=True)
class DPO:
    """The settings of a DPO run that its per-pair loss depends on (``trl.DPOConfig``'s names and defaults).

    Attributes:
        beta: the KL weight beta (IPO: its tau).
        loss_type: one loss type or several (summed with ``loss_weights``), among :data:`PAIR_LOSSES`.
        loss_weights: one weight per loss type (None: 1 each).
        label_smoothing: for ``robust`` and ``exo_pair`` (TRL's epsilon).
        f_divergence_type: one of :data:`F_DIVERGENCES` (``reverse_kl``: standard DPO).
        f_alpha_divergence_coef: alpha of ``alpha_divergence``.
        ld_alpha: LD-DPO's weight of the completion tokens past the shorter completion's length (None: 1, plain DPO).
        discopop_tau: the temperature of ``discopop``.
    """

    beta: float = 0.1
    loss_type: str | tuple[str, ...] = "sigmoid"
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    ld_alpha: float | None = None
    discopop_tau: float = 0.05

    def __post_init__(self) -> None:
        types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        object.__setattr__(self, "loss_type", types)
        if not types:
            raise ValueError("DPO.loss_type: give at least one loss type")
        for kind in types:
            if kind in BATCH_LOSSES:
                raise ValueError(f"DPO loss type {kind!r} {BATCH_LOSSES[kind]}: a pair has no gradient of its own. "
                                 f"Per-pair loss types: {', '.join(PAIR_LOSSES)}")
            if kind not in PAIR_LOSSES:
                raise ValueError(f"unknown DPO loss type {kind!r}; supported: {', '.join(PAIR_LOSSES)}")
        if self.loss_weights is not None:
            weights = tuple(float(w) for w in self.loss_weights)
            if len(weights) != len(types):
                raise ValueError(f"DPO.loss_weights: {len(weights)} weights for {len(types)} loss types")
            object.__setattr__(self, "loss_weights", weights)
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"DPO.beta must be a positive number, got {self.beta!r}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"DPO.f_divergence_type must be one of {', '.join(F_DIVERGENCES)}, got "
                             f"{self.f_divergence_type!r}")
        if "robust" in types and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError("DPO loss type 'robust' needs 0 <= label_smoothing < 0.5")
        if "exo_pair" in types and self.label_smoothing == 0.0:
            raise ValueError("DPO loss type 'exo_pair' needs label_smoothing > 0 (its epsilon)")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"DPO.ld_alpha must be in [0, 1], got {self.ld_alpha!r}")

    @classmethod
    def of(cls, config: Any) -> DPO:
        """The settings of a ``trl.DPOConfig`` (or any object with its fields: a ``DPOTrainer``'s ``args``).

        Raises ValueError for what a per-pair loss cannot reproduce: ``use_weighting`` (WPO weights from the
        policy's full distribution), a batch-coupled loss type (:data:`BATCH_LOSSES`)."""
        if getattr(config, "use_weighting", False):
            raise ValueError("DPOConfig(use_weighting=True) (WPO) weights each pair by the policy's own token "
                             "distribution, which gradtrace's DPO loss does not compute; the callback inside "
                             "DPOTrainer captures it exactly, collect afterwards cannot")
        names = ("beta", "loss_type", "loss_weights", "label_smoothing", "f_divergence_type", "f_alpha_divergence_coef",
                 "ld_alpha", "discopop_tau")
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        if isinstance(values.get("loss_type"), list):
            values["loss_type"] = tuple(values["loss_type"])
        if values.get("loss_weights") is not None:
            values["loss_weights"] = tuple(values["loss_weights"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (recorded in a store's manifest)."""
        out = asdict(self)
        out["loss_type"] = list(self.loss_type)
        out["loss_weights"] = None if self.loss_weights is None else list(self.loss_weights)
        return out

    def _scores(self, logratios: Tensor) -> Tensor:
        """TRL's ``chosen_scores`` / ``rejected_scores``: the f-divergence's f'(t) of the log-ratio."""
        kind = self.f_divergence_type
        if kind == "reverse_kl":
            return logratios
        if kind == "forward_kl":
            return 1 - torch.exp(-logratios)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(logratios)
        alpha = self.f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        clamp = {torch.float16: 11.0}.get(logratios.dtype, 80.0)
        t = torch.clamp(((alpha - 1.0) * logratios).float(), max=clamp)
        return (torch.exp(t) - 1.0).to(logratios.dtype) / (alpha - 1.0)

    def pair_losses(self, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
                    ref_rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor) -> Tensor:
        """``[P]`` loss of each pair from its summed log-probabilities (``[P]`` each: policy and reference, chosen and
        rejected) and its completions' token counts (``[P]``; IPO and ``sigmoid_norm`` average over them): the
        weighted sum over ``loss_type`` of TRL's per-sequence losses."""
        beta, eps = self.beta, self.label_smoothing
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        chosen_scores, rejected_scores = self._scores(chosen_logratios), self._scores(rejected_logratios)
        delta = chosen_scores - rejected_scores
        chosen_count, rejected_count = chosen_tokens.clamp(min=1.0), rejected_tokens.clamp(min=1.0)
        total = torch.zeros_like(delta)
        weights = self.loss_weights or (1.0,) * len(self.loss_type)
        for kind, weight in zip(self.loss_type, weights):
            if kind == "sigmoid":
                loss = -F.logsigmoid(beta * delta)
            elif kind == "hinge":
                loss = torch.relu(1 - beta * delta)
            elif kind in ("ipo", "sigmoid_norm"):  # per-token averages of the scores
                normed = chosen_scores / chosen_count - rejected_scores / rejected_count
                loss = (normed - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * normed)
            elif kind == "exo_pair":
                log_pw, log_pl = math.log1p(-eps), math.log(eps)
                loss = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - log_pw)
                        + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - log_pl))
            elif kind == "nca_pair":
                chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
                loss = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                        - 0.5 * F.logsigmoid(-rejected_rewards))
            elif kind == "robust":
                loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
            elif kind == "bco_pair":
                loss = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
            elif kind == "sppo_hard":
                loss = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
            elif kind == "apo_zero":
                loss = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
            elif kind == "apo_down":
                loss = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios
                                                                                         - rejected_logratios))
            else:  # discopop
                logits = beta * delta
                modulation = torch.sigmoid(logits / self.discopop_tau)
                loss = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
            total = total + weight * loss
        return total


def pair_rows(batch: dict[str, Any]) -> dict[str, Tensor]:
    """The ``2P`` rows of a batch of ``P`` pairs, chosen rows first (TRL's concatenated layout): ``input_ids``,
    ``attention_mask``, ``labels`` ``[2P, T]``, right-padded to the longer side (padding: masked, labels -100)."""
    missing = [f"{side}_{key}" for side in ("chosen", "rejected") for key in _ROW_KEYS if f"{side}_{key}" not in batch]
    if missing:
        raise ValueError(f"a preference batch needs {', '.join(missing)} (gradtrace.data.load_preference makes such "
                         f"batches); it has: {', '.join(sorted(map(str, batch)))}")
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}

    def joined(key: str) -> Tensor:
        parts = [batch[f"{side}_{key}"] for side in ("chosen", "rejected")]
        return torch.cat([F.pad(p, (0, width - p.shape[1]), value=fill[key]) for p in parts])

    return {key: joined(key) for key in _ROW_KEYS}


def sequence_logps(model: nn.Module, rows: dict[str, Tensor], ld_alpha: float | None = None) -> Tensor:
    """``[2P]`` float32 log-probability of each row's completion (its label tokens, summed), in one forward call.

    ``ld_alpha`` (LD-DPO): tokens past the shorter completion of a pair count ``ld_alpha`` times (rows ``i`` and
    ``P + i`` are a pair). Differentiable when gradients are enabled."""
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits  # [2P, T, V]
    labels = rows["labels"].to(logits.device)
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)  # t predicts t + 1
    per_token = -token_cross_entropy(logits.flatten(0, 1), targets.flatten()).view(targets.shape)  # 0 where ignored
    if ld_alpha is None:
        return per_token.sum(1)
    mask = targets != -100
    position = mask.long().cumsum(1)  # [2P, T] completion tokens up to here
    chosen_lens, rejected_lens = mask.sum(1).chunk(2)
    shared = torch.minimum(chosen_lens, rejected_lens).repeat(2).unsqueeze(1)  # [2P, 1]
    shared_mask = (position > 0) & (position <= shared)
    return (per_token * shared_mask).sum(1) + ld_alpha * (per_token * (position > shared)).sum(1)


def reference_logps(model: nn.Module, batch: dict[str, Any], settings: DPO | None = None) -> tuple[Tensor, Tensor]:
    """``(ref_chosen_logps, ref_rejected_logps)`` ``[P]`` each: the reference model's summed completion
    log-probabilities of a preference batch (no gradient; ``settings.ld_alpha`` applies as in the loss)."""
    device = next(model.parameters()).device
    rows = {k: v.to(device) for k, v in pair_rows(batch).items()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logps = sequence_logps(model, rows, settings.ld_alpha if settings is not None else None)
    finally:
        model.train(was_training)
    chosen, rejected = logps.chunk(2)
    return chosen, rejected


class DPOLoss:
    """The per-pair DPO loss of a batch of preference pairs, for :func:`gradtrace.collect` (``loss_fn(model, batch)
    -> [P]``): the gradient collected for a pair is that of its own loss.

    Args:
        settings: the run's :class:`DPO` settings (beta, loss types, ...; default: TRL's defaults).

    The batches must hold the reference log-probabilities (:data:`REFERENCE_KEYS`):
    ``gradtrace.data.PreferenceDataset.with_reference(ref_model)`` computes them once, or the data has TRL's
    precomputed columns.
    """

    def __init__(self, settings: DPO | None = None) -> None:
        if settings is not None and not isinstance(settings, DPO):
            raise TypeError(f"DPOLoss(settings=...) takes a gradtrace.loss.preference.DPO, got "
                            f"{type(settings).__name__}")
        self.settings = settings if settings is not None else DPO()

    def __repr__(self) -> str:
        return f"DPOLoss({self.settings!r})"

    def capture_info(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the capture must know about the forward call :meth:`__call__` makes (``Capture.annotate``'s
        keywords): row ``i`` (chosen) and row ``P + i`` (rejected) are pair ``i``; the labels are the rows'."""
        rows = pair_rows(batch)
        count = batch["chosen_input_ids"].shape[0]
        device = batch["chosen_input_ids"].device
        return {"row_examples": torch.arange(count, device=device).repeat(2), "labels": rows["labels"]}

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        """``[P]`` DPO loss of each pair of ``batch`` (one forward call of its ``2P`` rows)."""
        missing = [key for key in REFERENCE_KEYS if batch.get(key) is None]
        if missing:
            raise ValueError(f"the DPO loss needs the reference model's log-probabilities ({', '.join(missing)}): "
                             "compute them once with PreferenceDataset.with_reference(ref_model) (gradtrace collect "
                             "--ref-model), or keep the columns TRL's precompute_ref_log_probs stores in the data")
        rows = pair_rows(batch)
        logps = sequence_logps(model, rows, self.settings.ld_alpha)
        chosen, rejected = logps.chunk(2)
        counts = (rows["labels"] != -100).sum(1).to(logps.device, torch.float32)
        chosen_tokens, rejected_tokens = counts.chunk(2)
        ref_chosen, ref_rejected = (torch.as_tensor(batch[key]).to(logps.device, logps.dtype) for key in REFERENCE_KEYS)
        return self.settings.pair_losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)

