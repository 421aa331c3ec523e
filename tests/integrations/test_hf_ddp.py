"""GradtraceCallback under DDP: 2 gloo processes on CPU write one store, equal to brute force."""

from __future__ import annotations

import torch

import gradtrace
from tests import tiny
from tests.distributed.launch import run_ranks
from tests.integrations import ddp_jobs
from tests.integrations.common import assert_rows_close, causal_loss, lm_rows, reference_rows


def test_trainer_under_ddp_equals_brute_force(tmp_path):
    """The Trainer averages the token count over both ranks and multiplies each rank's loss by 2
    (average_tokens_across_devices); every row is still its example's own summed token loss gradient."""
    results = run_ranks(ddp_jobs.trainer_ddp, str(tmp_path), timeout=120)
    assert [r["wrapped"] for r in results] == ["DistributedDataParallel"] * 2
    store = gradtrace.GradientStore.open(tmp_path / "store")
    assert len(store) == 24 and sorted(store.ids, key=int) == [str(i) for i in range(24)]  # each rank its half
    assert len({s.rank for s in store.shards}) == 2
    config = store.manifest["config"]["trainer"]
    assert config["loss"]["rules"] == ["sum / num_items_in_batch x processes"] and config["loss"]["processes"] == 2
    states = torch.load(tmp_path / "states.pt", weights_only=True)
    rows = {str(i): r for i, r in enumerate(lm_rows(24))}
    got, want = reference_rows(tiny.gpt2(), store, states, rows, causal_loss)
    assert_rows_close(store, got, want)
