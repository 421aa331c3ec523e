"""Online selection under DDP (2 gloo ranks): after the step's pre-hook every rank's param.grad is the gradient of
the global mean loss over the kept examples of *both* ranks (the dropped contributions are all-reduced)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import jobs
from tests.distributed.launch import run_ranks


@pytest.mark.parametrize("renormalize", [False, True])
def test_ddp_selection_equals_global_kept_gradient(renormalize):
    results = run_ranks(jobs.ddp_selection, renormalize)
    dropped = set(results[0]["dropped"]) | set(results[1]["dropped"])
    data = jobs.dataset("mlp")
    keep = [i for i, ident in enumerate(jobs.IDS) if ident not in dropped]
    assert 0 < len(keep) < jobs.NUM_EXAMPLES
    model = jobs.build("mlp")
    denominator = len(keep) if renormalize else jobs.NUM_EXAMPLES
    (F.cross_entropy(model(data["x"][keep]), data["y"][keep], reduction="sum") / denominator).backward()
    for rank_result in results:
        for name, param in model.named_parameters():
            assert torch.allclose(rank_result["grads"][name], param.grad, rtol=1e-4, atol=1e-6), name
