"""TRL's ``DPOTrainer`` under :class:`~gradtrace.integrations.hf.GradtraceCallback`: one row per preference pair.

A DPO micro-batch of ``P`` pairs is ``2P`` rows -- the chosen rows, then the rejected rows (TRL's concatenated
forward) -- with a ``completion_mask``. TRL's ``_compute_loss`` sums each row's completion log-probabilities, forms
each pair's loss from its two rows (and the reference model's log-probabilities) and takes the mean over the
pairs; the Trainer then divides by the gradient accumulation steps ``A`` (unless the loss counts
``num_items_in_batch``, which TRL's DPO loss does not). Every pair's term depends on its own two rows only, so the
capture joins rows ``i`` and ``P + i`` into one example (``row_examples``) and multiplies its gradient by
``P * A``: each row of the store is the gradient of that pair's own DPO loss, for every ``loss_type`` whose loss is
per pair (:data:`gradtrace.loss.preference.PAIR_LOSSES`), with WPO weights (``use_weighting``) and LD-DPO
(``ld_alpha``) as the trainer applies them. The AMP grad scaler's scale is removed as for any Trainer.

Refused: loss types that couple the pairs of a batch (``aot``, ``aot_unpaired``, ``sft``:
:data:`gradtrace.loss.preference.BATCH_LOSSES`) and the MoE router's load-balancing loss (``router_aux_loss_coef``
with ``output_router_logits``), which couples every row of the batch.

Ids: ``ids=None`` gives each pair the content hash of its chosen tokens followed by its rejected tokens -- the id
:func:`gradtrace.data.load_preference` gives the same pair, so a store captured in training and one collected
afterwards share ids; ``ids="index"`` or an id column work as for any Trainer.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..loss.preference import BATCH_LOSSES

__all__ = ["DPOPairs", "is_dpo_trainer"]


def is_dpo_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is a TRL ``DPOTrainer`` (or a subclass); TRL is not imported for it."""
    module = sys.modules.get("trl.trainer.dpo_trainer")
    dpo = getattr(module, "DPOTrainer", None) if module is not None else None
    return dpo is not None and isinstance(trainer, dpo)


class DPOPairs:
    """The DPO side of one ``train()`` call: how each ``compute_loss`` call's rows form pairs, and their scale.

    Args:
        trainer: the ``DPOTrainer``.

    Raises:
        ValueError: a batch-coupled ``loss_type`` or a MoE router loss.
    """

    def __init__(self, trainer: Any) -> None:
        types = list(getattr(trainer, "loss_types", None) or [getattr(trainer.args, "loss_type", "sigmoid")])
        coupled = [kind for kind in types if kind in BATCH_LOSSES]
        if coupled:
            raise ValueError(f"gradtrace: DPO loss_type {coupled[0]!r} {BATCH_LOSSES[coupled[0]]}: a pair has no "
                             "gradient of its own, so GradtraceCallback cannot capture it; train with a per-pair loss "
                             "type (sigmoid, ipo, hinge, ...)")
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError("gradtrace: the MoE router's load-balancing loss couples the rows of a DPO batch, so no "
                             "pair has a gradient of its own; train with router_aux_loss_coef=0 or without "
                             "output_router_logits")
        self.trainer = trainer
        self.loss_types = types

    def annotation(self, inputs: Mapping[str, Any], num_items: Any) -> dict[str, Tensor]:
        """``labels`` (``[2P, T]``: the completion tokens, -100 elsewhere), ``row_examples`` (``[2P]``: rows ``i``
        and ``P + i`` are pair ``i``) and ``example_scale`` (``[P]``: ``P * A``) of one ``compute_loss`` call."""
        try:
            input_ids, completion = inputs["input_ids"], inputs["completion_mask"]
        except (KeyError, TypeError) as err:
            raise ValueError("gradtrace: a DPOTrainer compute_loss call without input_ids and completion_mask; a "
                             "DPOTrainer subclass or collator that changes the inputs is not supported") from err
        rows = int(input_ids.shape[0])
        if rows % 2:
            raise ValueError(f"gradtrace: a DPO batch of {rows} rows; TRL's batches hold the chosen rows, then the "
                             "rejected rows")
        pairs = rows // 2
        labels = input_ids.masked_fill(completion == 0, -100)
        scale = float(pairs) * self._accumulation(num_items)
        return {"labels": labels, "row_examples": torch.arange(pairs, device=input_ids.device).repeat(2),
                "example_scale": torch.full((pairs,), scale, device=input_ids.device)}

    def _accumulation(self, num_items: Any) -> float:
        """The Trainer's division of the loss by the accumulation steps (its ``loss_is_scaled_for_ga`` rule)."""
        trainer = self.trainer
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = ((getattr(trainer, "model_accepts_loss_kwargs", False) and num_items is not None)
                      or getattr(trainer, "compute_loss_func", None) is not None)
        return 1.0 if scaled else float(trainer.current_gradient_accumulation_steps)

    def describe(self) -> dict[str, Any]:
        """The DPO loss as recorded in the store's ``config["trainer"]["loss"]``."""
        trainer, args = self.trainer, self.trainer.args
        settings = {name: getattr(args, name, None) for name in ("beta", "label_smoothing", "f_divergence_type",
                                                                 "f_alpha_divergence_coef", "ld_alpha",
                                                                 "use_weighting", "loss_weights")}
        settings["beta"] = float(getattr(trainer, "beta", settings["beta"]))
        return {"trainer_loss": "DPO", "loss_type": self.loss_types, "per_pair": "the pair's own DPO loss (TRL's "
                "per-sequence loss of its chosen and rejected rows)", "scale": "pairs x accumulation steps",
                **settings, "precompute_ref_log_probs": bool(getattr(trainer, "precompute_ref_logps", False)),
                "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
                "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else None}
