"""LoGra projects a bf16/fp16 input in float32 by blocks of rows (issue #30, item 2): the same values as projecting
its whole float32 upcast, without ever holding that upcast."""

from __future__ import annotations

import pytest
import torch

import gradtrace.projection.logra as logra
from gradtrace.projection.logra import LoGra, Projector
from tests.loss.test_low_precision import _peak_allocated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocked_upcast_equals_the_whole_upcast(dtype):
    projector = Projector(LoGra(rank=8, seed=3))
    x = torch.randn(6, 130, 2048, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = torch.matmul(x.to(torch.float64), projector.matrix("w", "rows", 2048).t().to(torch.float64))
    got = projector.project("w", "rows", x)
    assert got.dtype == torch.float32 and got.shape == (6, 130, 8)
    # float32 products of 2048 exact (bf16/fp16) inputs: round-off about 2048 * eps32 of the terms' size
    bound = 2048 * torch.finfo(torch.float32).eps * float(x.abs().max() * projector.matrix("w", "rows", 2048).abs()
                                                           .max())
    assert float((got.to(torch.float64) - want).abs().max()) <= bound


def test_a_vocabulary_sized_input_is_never_upcast_whole(monkeypatch):
    monkeypatch.setattr(logra, "UPCAST_BLOCK", 1 << 16)
    projector = Projector(LoGra(rank=4))
    x = torch.randn(512, 4096).to(torch.bfloat16)  # a float32 copy: 8 MiB
    projector.matrix("w", "rows", 4096)  # made (and cached) outside the measured region
    peak = _peak_allocated(lambda: projector.project("w", "rows", x))
    assert peak < 2 * (1 << 16) * 4 + 512 * 4 * 4 + (1 << 20), peak  # a block or two and the [512, 4] output
