"""``torch.nn.Embedding``: ``dW = sum_t onehot(id_t) s_t^T`` (``[num_embeddings, dim]``).

The one-hot rows are kept as integer ids (``-1`` for ``padding_idx`` tokens, whose row never
receives a gradient), so an exact capture never holds a vocabulary-sized tensor per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...grad.terms import OuterTerm, Term
from ...projection.logra import Projector
from .base import LayerHandler, TokenScale, projected_outer, register_layer, scaled, tokens_last


@register_layer
class EmbeddingHandler(LayerHandler):
    kind = "embedding"
    activation_side = "rows"

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, nn.Embedding)

    @classmethod
    def param_roles(cls, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def stock(self):
        return nn.Embedding, lambda gen: torch.randint(0, self.module.num_embeddings, (2, 3), generator=gen)

    def unsupported_reason(self) -> str | None:
        if self.module.scale_grad_by_freq:
            return "scale_grad_by_freq=True scales gradients by token counts over the whole batch"
        return super().unsupported_reason()

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        if inputs.dim() < 1:
            raise ValueError(f"{self.name}: expected batched token ids, got a scalar")
        ids = inputs.reshape(inputs.shape[0], -1)  # [B, T]
        padding_idx = self.module.padding_idx
        if padding_idx is not None:
            ids = ids.masked_fill(ids == padding_idx, -1)
        if projector is not None:
            return projector.project_index(self.params["weight"], "rows", self.module.num_embeddings, ids)
        return ids

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        dim = self.module.embedding_dim
        out_grads = tokens_last(self.rescale(grad_output), dim)  # [B, T, dim]
        if projector is not None:
            cols = scaled(projector.project(self.params["weight"], "cols", out_grads), scale)
            return {"weight": projected_outer(projector, saved, cols, scale)}
        cols = scaled(out_grads, scale)
        return {"weight": OuterTerm(rows=saved, cols=cols, n_rows=self.module.num_embeddings, n_cols=dim)}
