"""The replay reproduces the recorded loop: optimizer formulas, clipping, schedules, accumulation."""

from __future__ import annotations

import pytest
import torch

from gradtrace.replay import load_run, replay
from gradtrace.replay.replay import final_difference

from .tasks import batcher, loss_fn, make_data, make_model, schedule, train


def _max_diff(model, state):
    return max((p.detach() - state.params[n]).abs().max().item() for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer,clip,warmup,accum", [
    ("sgd", None, None, 1), ("nesterov", 0.5, 2, 2), ("adamw", 0.3, 3, 1), ("adam", None, 2, 2)])
def test_replay_is_bit_identical_to_the_single_tensor_loop(tmp_path, dtype, optimizer, clip, warmup, accum):
    data = make_data(dtype=dtype)
    steps = schedule(accumulation=accum)
    model = train(make_model("mlp", dtype), optimizer, steps, data, accumulation=accum, grad_clip=clip,
                  warmup=warmup, record=tmp_path / "run")
    run = load_run(tmp_path / "run")
    result = replay(run, make_model("mlp", dtype, seed=5), loss_fn, batcher(data))
    assert _max_diff(model, result.state) == 0.0
    assert result.difference == 0.0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_replay_of_a_foreach_loop_is_bit_identical_too(tmp_path, optimizer):
    """The replay's states go through torch's own kernels, the recorded foreach path included."""
    data = make_data(dtype=torch.float32)
    model = train(make_model("mlp", torch.float32), optimizer, schedule(), data, grad_clip=0.5, warmup=2,
                  record=tmp_path / "run", foreach=True)
    result = replay(load_run(tmp_path / "run"), make_model("mlp", torch.float32), loss_fn, batcher(data))
    assert _max_diff(model, result.state) == 0.0


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_a_long_fused_adam_loop_replays_bit_for_bit(tmp_path, kind):
    """300 fused-kernel steps: the differentiable formulas alone round otherwise and drift; the replay's states
    come from the fused kernel itself."""
    from gradtrace.replay import RunRecorder

    data = make_data(n=12, dtype=torch.float32)
    model = make_model("mlp", torch.float32)
    opt = kind(model.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    rec = RunRecorder(tmp_path / "run", model, opt)
    batches = batcher(data)
    ids = list(data)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        chosen = [ids[i] for i in torch.randperm(len(ids), generator=generator)[:4].tolist()]
        loss_fn(model, batches(chosen)).mean().backward()
        opt.step()
        opt.zero_grad()
        rec.step(chosen)
    rec.finish(model)
    run = load_run(tmp_path / "run")
    assert run.optimizer.implementation == "fused"
    result = replay(run, make_model("mlp", torch.float32, seed=5), loss_fn, batches)
    assert _max_diff(model, result.state) == 0.0 and result.difference == 0.0


def test_the_recorded_learning_rates_follow_the_scheduler(tmp_path):
    data = make_data()
    train(make_model("linear"), "adamw", schedule(), data, warmup=3, record=tmp_path / "run")
    lrs = [s.lrs[0] for s in load_run(tmp_path / "run").steps]
    assert lrs[0] == 0.0 and lrs[3] == pytest.approx(0.05) and lrs[-1] < lrs[4]


def test_a_replay_that_drifts_is_refused(tmp_path):
    data = make_data()
    train(make_model("mlp"), "sgd", schedule(), data, record=tmp_path / "run")
    run = load_run(tmp_path / "run")
    other = make_data(seed=3)
    with pytest.raises(Exception, match="does not reproduce the recorded run: final weights differ by"):
        replay(run, make_model("mlp"), loss_fn, batcher(other))
    assert final_difference(run, replay(run, make_model("mlp"), loss_fn, batcher(data)).state) == 0.0
