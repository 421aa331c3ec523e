"""TracIn over checkpoints (Pruthi et al. 2020): ``sum_c eta_c <g_q(theta_c), g_i(theta_c)>``.

Each checkpoint ``c`` contributes its gradient inner products weighted by the learning rate ``eta_c`` in
effect over the interval it stands for (unweighted sums over checkpoints are a known pitfall); each finite and
``>= 0`` (a negative one would flip the sign of its checkpoint's scores), not all 0.
``normalize=True`` uses cosine similarities instead of inner products at every checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ...common.checks import rates
from .base import Method, MissingStage, register_method
from .similarity import _normalize

__all__ = ["TracIn"]


@register_method
class TracIn(Method):
    name = "tracin"
    multi_checkpoint = True
    needs = ("checkpoints",)
    description = "learning-rate weighted gradient inner products summed over checkpoints (positive = helpful)"

    def __init__(self, weights: Sequence[float] | None = None, normalize: bool = False) -> None:
        self.weights = rates(weights, "tracin learning rates") if weights is not None else None
        self.normalize = normalize

    def check_ready(self) -> None:
        if self.weights is None:
            raise MissingStage("tracin needs the learning rate of each checkpoint: "
                               "Attributor('tracin', train=[store_1, ...], weights=[lr_1, ...])")

    def checkpoint_weights(self, count: int) -> list[float]:
        self.check_ready()
        if len(self.weights) != count:
            raise ValueError(f"tracin: {len(self.weights)} learning rates for {count} checkpoints")
        return list(self.weights)

    def prepare_queries(self, queries: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(queries) if self.normalize else queries

    def prepare_train(self, block: Tensor, checkpoint: int = 0) -> Tensor:
        return _normalize(block) if self.normalize else block

    def options(self) -> dict[str, Any]:
        return {"weights": self.weights, "normalize": self.normalize}
