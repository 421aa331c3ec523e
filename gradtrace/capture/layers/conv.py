"""``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``): a linear layer over unfolded input patches.

The input is padded exactly as the module pads it (any ``padding_mode``, ``"same"`` included) and
unfolded to ``[B, L, C_in*k]`` patches, the output-gradient to ``[B, L, C_out]``; then
``dW = sum_L s_L u_L^T`` reshaped to ``[C_out, C_in, *kernel]`` and ``db = sum_L s_L``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...grad.terms import OuterTerm, Term, VectorTerm
from ...projection.logra import Projector
from .base import LayerHandler, TokenScale, projected_outer, projected_vector, register_layer, scaled


@register_layer
class ConvHandler(LayerHandler):
    kind = "conv"
    activation_side = "cols"

    def __init__(self, name: str, module: nn.Module, params: dict[str, str]) -> None:
        super().__init__(name, module, params)
        self.spatial = 1 if isinstance(module, nn.Conv1d) else 2
        self.patch = module.in_channels * math.prod(module.kernel_size)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, (nn.Conv1d, nn.Conv2d))

    def stock(self):
        module = self.module
        pad = max(module._reversed_padding_repeated_twice, default=0)
        sizes = [d * (k - 1) + 2 * pad + 3 for d, k in zip(module.dilation, module.kernel_size)]
        stock = nn.Conv1d if self.spatial == 1 else nn.Conv2d
        return stock, lambda gen: torch.randn(2, module.in_channels, *sizes, generator=gen)

    def unsupported_reason(self) -> str | None:
        if self.module.groups != 1:
            return f"grouped convolution (groups={self.module.groups}) is not supported yet"
        return super().unsupported_reason()

    def _unfold(self, x: Tensor) -> Tensor:
        """Input ``[B, C, *spatial]`` -> patches ``[B, L, C*prod(kernel)]`` in weight layout order."""
        module = self.module
        if x.dim() != self.spatial + 2:
            raise ValueError(f"{self.name}: expected a batched input with {self.spatial} spatial dims, "
                             f"got shape {tuple(x.shape)}")
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        if self.spatial == 1:
            x = x.unsqueeze(2)
            kernel, dilation, stride = (1, *module.kernel_size), (1, *module.dilation), (1, *module.stride)
        else:
            kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
        patches = F.unfold(x, kernel, dilation=dilation, padding=0, stride=stride)  # [B, C*k, L]
        return patches.transpose(1, 2)

    def forward(self, inputs: Tensor, projector: Projector | None) -> Any:
        patches = self._unfold(inputs)
        if projector is not None and "weight" in self.params:
            return projector.project(self.params["weight"], "cols", patches)
        return patches

    def backward(self, saved: Any, grad_output: Tensor, scale: TokenScale,
                 projector: Projector | None) -> dict[str, Term]:
        out_grads = self.rescale(grad_output)
        out_grads = out_grads.reshape(out_grads.shape[0], self.module.out_channels, -1).transpose(1, 2)
        exact = scaled(out_grads, scale) if projector is None else None
        terms: dict[str, Term] = {}
        if "weight" in self.params:
            if projector is not None:
                grads = scaled(projector.project(self.params["weight"], "rows", out_grads), scale)
                terms["weight"] = projected_outer(projector, grads, saved, scale)
            else:
                terms["weight"] = OuterTerm(rows=exact, cols=saved, n_rows=exact.shape[-1], n_cols=saved.shape[-1])
        if "bias" in self.params:
            terms["bias"] = (VectorTerm(exact) if projector is None
                             else projected_vector(projector, self.params["bias"], out_grads, scale))
        return terms
