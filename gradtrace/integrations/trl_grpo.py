"""TRL's ``GRPOTrainer`` under :class:`~gradtrace.integrations.hf.GradtraceCallback`: one row per completion.

A GRPO micro-batch is a set of completions (rows ``i``: prompt + completion tokens) with their advantages. TRL's
``_compute_loss`` forms a per-token loss ``l[i, t]`` (the clipped, advantage-weighted ratio of its ``loss_type``,
plus ``beta`` times the KL estimate to the reference model, times the off-policy / entropy / importance-sampling
masks where enabled) and reduces it over the completion tokens ``m[i, t]`` (the completion mask, times the tool
mask) in a way that depends on ``loss_type``. Every completion's term of that batch loss depends on its own row
only, so the hook gradient of row ``i`` is the gradient of its term, and the capture turns it into the gradient of

    L_i = sum_t m[i, t] * l[i, t]         (``Loss(example_loss="sum")``, the default)
    L_i / sum_t m[i, t]                   (``Loss(example_loss="mean")``)

by multiplying it by the factor ``s_i`` the trainer divided ``L_i`` by (recorded as each row's scale; ``A``: the
gradient accumulation steps of the optimizer step, ``B``: the completions of the micro-batch):

==========================  ==================================================================================
``loss_type``               ``s_i`` (the trainer's loss is ``sum_i L_i / s_i``)
==========================  ==================================================================================
``grpo``, ``sapo``          ``B * A * max(1, sum_t m[i, t])`` (mean over completions of each one's token mean)
``bnpo``                    ``A * max(1, sum_{i, t} m[i, t])`` (token mean over the micro-batch)
``dr_grpo``                 ``B * A * max_completion_length``
``dapo``, ``cispo``,        ``max(1, num_items_in_batch) / processes * A / steps_per_generation``
``vespo``                   (``num_items_in_batch``: completion tokens of the whole generation batch)
``luspo``                   ``B * A`` (mean over completions of each one's token sum)
==========================  ==================================================================================

The AMP grad scaler's scale is removed as for any Trainer (:mod:`.trainer_loss`). Terms that couple the rows --
the MoE router's load-balancing loss (``router_aux_loss_coef``) -- and the entropy bonus (``entropy_coef``, whose
token mean has another normaliser and whose gradient the unfused LM head does not carry) are refused.

Ids: each completion's id is ``f"{prompt}/{rollout}/{group}.{k}"`` -- ``prompt``: the prompt's id (its dataset
row, its id column, or with ``ids=None`` a content hash of its tokens); ``rollout``: the optimizer step at which
the completions were generated (``"{step}.{j}"`` for the ``j``-th generation within one step, ``j > 0``);
``group``: the prompt's group in the generation batch (TRL normalises advantages per group); ``k``: the
completion's index among the group's ``num_generations``. The rows also carry the fields ``prompt``, ``rollout``,
``group``, ``completion`` (``k``) and ``advantage``, so that completions can be grouped by prompt. With
``num_iterations > 1`` a completion is trained on several times: ``trajectory=True`` keeps every use.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..data.ids import content_hash
from .trainer_ids import ID_KEY, prepare_ids

__all__ = ["GRPORollouts", "LOSS_TYPES", "is_grpo_trainer"]

LOSS_TYPES = {
    "grpo": "rows x accumulation steps x completion tokens",
    "sapo": "rows x accumulation steps x completion tokens",
    "bnpo": "accumulation steps x completion tokens of the micro-batch",
    "dr_grpo": "rows x accumulation steps x max_completion_length",
    "dapo": "num_items_in_batch / processes x accumulation steps / steps_per_generation",
    "cispo": "num_items_in_batch / processes x accumulation steps / steps_per_generation",
    "vespo": "num_items_in_batch / processes x accumulation steps / steps_per_generation",
    "luspo": "rows x accumulation steps",
}
"""The ``loss_type`` values of TRL's ``GRPOTrainer`` that are supported, with the scale ``s_i`` of each row."""

FIELDS = ("prompt", "rollout", "group", "completion", "advantage")


def is_grpo_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is a TRL ``GRPOTrainer`` (or a subclass); TRL is not imported for it."""
    module = sys.modules.get("trl.trainer.grpo_trainer")
    grpo = getattr(module, "GRPOTrainer", None) if module is not None else None
    return grpo is not None and isinstance(trainer, grpo)


class GRPORollouts:
    """The GRPO side of one ``train()`` call: completion ids, per-completion scales, row fields.

    Args:
        trainer: the ``GRPOTrainer``.
        ids: where a prompt's id comes from, as for :class:`~gradtrace.integrations.hf.GradtraceCallback`:
            ``"index"``, an id column, or None (a content hash of the prompt's tokens).

    Raises:
        ValueError: a ``loss_type`` not in :data:`LOSS_TYPES`, an entropy bonus or a MoE router loss.
    """

    def __init__(self, trainer: Any, ids: str | None) -> None:
        loss_type = getattr(trainer, "loss_type", None)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"gradtrace: GRPOTrainer loss_type={loss_type!r} is not supported by GradtraceCallback "
                             f"(supported: {sorted(LOSS_TYPES)})")
        if getattr(trainer, "_entropy_bonus_enabled", False):
            raise ValueError("gradtrace: the GRPO entropy bonus (entropy_coef) is a token mean over the micro-batch "
                             "whose normaliser differs from the policy loss's; per-completion gradients with it are "
                             "not supported: set entropy_coef=0")
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError("gradtrace: the MoE router's load-balancing loss couples the completions of a batch, so "
                             "no completion has a gradient of its own; train with GRPOConfig(router_aux_loss_coef=0)")
        self.trainer = trainer
        self.ids = ids
        self.loss_type: str = loss_type
        self.known: dict[str, tuple] = {}  # completion id -> FIELDS values, for the rollouts of the current buffer
        self._rollout: tuple[int, int] = (-1, -1)

    # -- install -------------------------------------------------------------------------------
    def install(self) -> Callable[[], None]:
        """Put the prompt ids into the training features and wrap the trainer's generation; returns the undo."""
        trainer = self.trainer
        undo_ids = prepare_ids(trainer, self.ids, collate=False) if self.ids is not None else None
        had_own = "_generate_and_score_completions" in vars(trainer)
        previous = vars(trainer).get("_generate_and_score_completions")
        original = trainer._generate_and_score_completions

        @functools.wraps(original)
        def generate(inputs: list, *args: Any, **kwargs: Any) -> dict:
            prompts = [f.get(ID_KEY) if isinstance(f, Mapping) else None for f in inputs]
            features = [{k: v for k, v in f.items() if k != ID_KEY} if isinstance(f, Mapping) else f for f in inputs]
            output = original(features, *args, **kwargs)
            if trainer.model.training and isinstance(output, dict):
                output[ID_KEY] = self._completion_ids(prompts, output)
            return output

        trainer._generate_and_score_completions = generate

        def undo() -> None:
            if had_own:
                trainer._generate_and_score_completions = previous
            else:
                vars(trainer).pop("_generate_and_score_completions", None)
            if undo_ids is not None:
                undo_ids()

        return undo

    def _completion_ids(self, prompts: list, output: dict) -> list[str]:
        """The id of each completion of a generation batch (in the batch's order, before TRL shuffles it)."""
        trainer = self.trainer
        step = int(trainer.state.global_step)
        last_step, last_j = self._rollout
        j = last_j + 1 if last_step == step else 0
        self._rollout = (step, j)
        rollout = f"{step}" if j == 0 else f"{step}.{j}"
        if self.ids is None:
            prompt_ids, prompt_mask = output["prompt_ids"].cpu(), output["prompt_mask"].bool().cpu()
            prompts = [content_hash(row[keep].numpy()) for row, keep in zip(prompt_ids, prompt_mask)]
        count = len(prompts)
        generations = int(trainer.num_generations)
        first = int(trainer.accelerator.process_index) * count  # this process's rows of the gathered batch
        advantages = output.get("advantages")
        values = (advantages.detach().float().cpu().tolist() if isinstance(advantages, Tensor)
                  and advantages.dim() == 1 else [None] * count)
        known: dict[str, tuple] = {}
        keys = []
        for row, (prompt, advantage) in enumerate(zip(prompts, values)):
            group, k = divmod(first + row, generations)
            key = f"{prompt}/{rollout}/{group}.{k}"
            known[key] = (prompt, rollout, group, k, advantage)
            keys.append(key)
        self.known = known  # the previous rollouts' rows were all written before this generation
        return keys

    # -- per compute_loss call -----------------------------------------------------------------
    def annotation(self, inputs: Mapping[str, Any]) -> dict[str, Tensor]:
        """``labels`` (``[B, P + C]``: the completion tokens the loss counts, -100 elsewhere) and ``example_scale``
        (``[B]``: each completion's ``s_i``, see the module docstring) of one ``compute_loss`` call."""
        trainer = self.trainer
        try:
            prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
            mask = inputs["completion_mask"]
        except (KeyError, TypeError) as err:
            raise ValueError("gradtrace: a GRPOTrainer compute_loss call without prompt_ids, completion_ids and "
                             "completion_mask; a GRPOTrainer subclass that changes the inputs is not supported"
                             ) from err
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        rows = completion_ids.shape[0]
        keep = mask.bool()
        labels = torch.cat([torch.full_like(prompt_ids, -100), completion_ids.masked_fill(~keep, -100)], dim=1)
        tokens = keep.sum(1).float()  # [B]
        accumulation = float(trainer.current_gradient_accumulation_steps)
        kind = self.loss_type
        if kind in ("grpo", "sapo"):
            scale = rows * accumulation * tokens.clamp(min=1.0)
        elif kind == "bnpo":
            scale = (accumulation * tokens.sum().clamp(min=1.0)).expand(rows)
        elif kind == "dr_grpo":
            scale = torch.full((rows,), rows * accumulation * float(trainer.max_completion_length),
                               device=tokens.device)
        elif kind == "luspo":
            scale = torch.full((rows,), rows * accumulation, device=tokens.device)
        else:  # dapo, cispo, vespo: num_items_in_batch spans the generation batch (over all processes)
            num_items = torch.as_tensor(inputs["num_items_in_batch"], device=tokens.device).float().clamp(min=1.0)
            per_window = accumulation / (trainer.accelerator.num_processes * trainer.args.steps_per_generation)
            scale = (num_items * per_window).expand(rows)
        return {"labels": labels, "example_scale": scale}

    # -- rows and the manifest ----------------------------------------------------------------
    def fields(self, ids: list) -> dict[str, list]:
        """The fields ``prompt``, ``rollout``, ``group``, ``completion`` and ``advantage`` of the rows ``ids``."""
        values = [self.known.get(i, (None,) * len(FIELDS)) for i in ids]
        return {name: [v[n] for v in values] for n, name in enumerate(FIELDS)}

    def describe(self, example_loss: str) -> dict[str, Any]:
        """The GRPO loss as recorded in the store's ``config["trainer"]["loss"]``."""
        trainer, args = self.trainer, self.trainer.args
        per_completion = ("sum over the completion's tokens of the per-token GRPO loss" if example_loss == "sum"
                          else "mean over the completion's tokens of the per-token GRPO loss")
        return {"trainer_loss": "GRPO", "loss_type": self.loss_type, "per_completion": per_completion,
                "scale": LOSS_TYPES[self.loss_type], "beta": float(trainer.beta),
                "epsilon_low": float(trainer.epsilon_low), "epsilon_high": float(trainer.epsilon_high),
                "delta": args.delta, "importance_sampling_level": trainer.importance_sampling_level,
                "num_generations": int(trainer.num_generations), "num_iterations": int(trainer.num_iterations),
                "steps_per_generation": int(args.steps_per_generation),
                "max_completion_length": int(trainer.max_completion_length),
                "scale_rewards": trainer.scale_rewards, "top_entropy_quantile": float(trainer.top_entropy_quantile),
                "off_policy_mask_threshold": trainer.off_policy_mask_threshold,
                "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
                "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else None}
