"""Metagradients equal autograd through the unrolled loop and finite differences of re-running training."""

from __future__ import annotations

import pytest
import torch

from gradtrace.options import MetagradOptions
from gradtrace.replay import load_run, metagradients

from .reference import query_loss, unrolled_dloss_dw
from .tasks import batcher, loss_fn, make_data, make_model, schedule, train

CONFIGS = {  # optimizer, accumulation, grad_clip, warmup
    "sgd_momentum_wd": ("sgd", 2, None, None),
    "nesterov": ("nesterov", 1, None, None),
    "adamw_cosine_clip": ("adamw", 1, 0.5, 3),
    "adam_l2": ("adam", 2, 1.0, 2),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _record(tmp_path, kind, config, data):
    optimizer, accum, clip, warmup = CONFIGS[config]
    steps = schedule(accumulation=accum)
    train(make_model(kind), optimizer, steps, data, accumulation=accum, grad_clip=clip, warmup=warmup,
          record=tmp_path / "run")
    return load_run(tmp_path / "run"), steps


QUERIES = list(make_data(n=3, seed=7).values())


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_metagradients_equal_autograd_through_the_unrolled_loop(tmp_path, kind, config):
    data = make_data()
    run, steps = _record(tmp_path, kind, config, data)
    got = metagradients(run, make_model(kind), loss_fn, batcher(data), QUERIES, query_loss,
                        train_ids=list(range(12)))
    optimizer, accum, clip, warmup = CONFIGS[config]
    ref = unrolled_dloss_dw(kind, optimizer, steps, data, QUERIES, accumulation=accum, grad_clip=clip, warmup=warmup)
    assert got.scores.shape == (3, 12)
    assert _rel(-got.scores, ref) <= 1e-8
    assert got.replay_difference == 0.0


@pytest.mark.parametrize("config", ["sgd_momentum_wd", "adamw_cosine_clip"])
def test_metagradients_equal_finite_differences_of_retraining(tmp_path, config):
    data = make_data()
    run, steps = _record(tmp_path, "mlp", config, data)
    got = metagradients(run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss,
                        train_ids=list(range(12)))
    optimizer, accum, clip, warmup = CONFIGS[config]
    h, fd = 1e-4, []
    for i in (0, 5, 11):
        losses = []
        for sign in (1, -1):
            weights = {i: torch.tensor(1 + sign * h, dtype=torch.float64)}
            model = train(make_model("mlp"), optimizer, steps, data, accumulation=accum, grad_clip=clip,
                          warmup=warmup, weights=weights)
            with torch.no_grad():
                losses.append(torch.stack([query_loss(model, q) for q in QUERIES]))
        fd.append((losses[0] - losses[1]) / (2 * h))
    fd = torch.stack(fd, dim=1)  # [Q, 3]
    assert _rel(-got.scores[:, [0, 5, 11]], fd) <= 1e-5


def test_the_result_does_not_depend_on_checkpoints_or_query_batching(tmp_path):
    data = make_data()
    run, _ = _record(tmp_path, "mlp", "adamw_cosine_clip", data)
    args = (run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    base = metagradients(*args).scores
    for every in (1, 2, 5, 9, 50):
        assert torch.equal(metagradients(*args, options=MetagradOptions(checkpoint_every=every)).scores, base)
    on_disk = MetagradOptions(memory_limit=0)  # every checkpoint on disk
    assert torch.equal(metagradients(*args, options=on_disk).scores, base)
    assert not list(run.run_dir.glob("metagrad_checkpoints*"))
    one = metagradients(*args, options=MetagradOptions(query_batch=1)).scores
    assert _rel(one, base) <= 1e-13
    assert _rel(metagradients(*args, options=MetagradOptions(query_batch=2)).scores, base) <= 1e-13


def test_sign_positive_means_helpful(tmp_path):
    data = make_data()
    run, _ = _record(tmp_path, "linear", "sgd_momentum_wd", data)
    # the query is a training example itself: training on it lowers its own loss, so it helps itself
    queries = [data[3]]
    got = metagradients(run, make_model("linear"), loss_fn, batcher(data), queries, query_loss,
                        train_ids=list(range(12)))
    assert got.scores[0, 3] > 0 and got.scores[0, 3] == got.scores[0].max()


def test_a_reverse_pass_that_overflows_is_refused_naming_the_steps(tmp_path, monkeypatch):
    """A NaN/inf reaching the cotangents (here injected at step 7 of 12, into query 1 only) stops the pass with
    the segment's steps and the queries it hit, instead of returning NaN scores."""
    import gradtrace.replay.metagrad as mg
    from gradtrace.replay.spec import ReplayError

    data = make_data()
    run, _ = _record(tmp_path, "mlp", "adamw_cosine_clip", data)
    args = (run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    real = mg.reverse_step

    def overflowing(steps, t, state, cotangent, batched):
        previous, weight_grads = real(steps, t, state, cotangent, batched)
        if t == 7:
            key = next(iter(previous))
            previous[key] = previous[key].clone()
            previous[key][1].view(-1)[0] = float("inf")
        return previous, weight_grads

    monkeypatch.setattr(mg, "reverse_step", overflowing)
    total = len(run.steps)
    with pytest.raises(ReplayError, match=r"overflowed \(NaN/inf\) between steps 6 and 8 of (\d+).*1 of the 3 "
                                          r"queries of this pass \(in it: \[1\]\).*float64") as err:
        metagradients(*args, options=MetagradOptions(checkpoint_every=3))
    assert f"of {total} " in str(err.value)


@pytest.mark.parametrize("config", ["sgd_momentum_wd", "adamw_cosine_clip", "adam_l2"])
@pytest.mark.parametrize("start", [1, 4, 8])
def test_a_truncated_pass_equals_autograd_with_the_weights_acting_from_its_start(tmp_path, config, start):
    """``start_step = K``: the exact derivative of the run whose weights act at steps K.. only (the unrolled loop
    with the weights of earlier steps held at 1), whatever the checkpoint spacing."""
    data = make_data()
    run, steps = _record(tmp_path, "mlp", config, data)
    optimizer, accum, clip, warmup = CONFIGS[config]
    ref = unrolled_dloss_dw("mlp", optimizer, steps, data, QUERIES, accumulation=accum, grad_clip=clip,
                            warmup=warmup, weights_from=start)
    full = unrolled_dloss_dw("mlp", optimizer, steps, data, QUERIES, accumulation=accum, grad_clip=clip,
                             warmup=warmup)
    args = (run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    for every in (None, 1, 3):
        got = metagradients(*args, train_ids=list(range(12)),
                            options=MetagradOptions(start_step=start, checkpoint_every=every))
        assert got.start_step == start and got.replay_difference == 0.0
        assert _rel(-got.scores, ref) <= 1e-8
    assert _rel(ref, full) > 1e-3  # the earlier steps matter here: the truncation is a different derivative
    assert got.growth[-1][0] == start  # the trace ends where the pass stops


def test_a_pass_over_the_last_step_alone_scores_its_examples_and_no_others(tmp_path):
    data = make_data()
    run, steps = _record(tmp_path, "linear", "sgd_momentum_wd", data)
    last = len(run.steps) - 1
    got = metagradients(run, make_model("linear"), loss_fn, batcher(data), QUERIES, query_loss,
                        train_ids=list(range(12)), options=MetagradOptions(start_step=last))
    seen = sorted({i for ids in steps[last] for i in ids})
    others = [i for i in range(12) if i not in seen]
    assert others and torch.equal(got.scores[:, others], torch.zeros(3, len(others), dtype=got.scores.dtype))
    assert bool((got.scores[:, seen] != 0).all())
    zero = metagradients(run, make_model("linear"), loss_fn, batcher(data), QUERIES, query_loss,
                         train_ids=list(range(12)), options=MetagradOptions(start_step=0))
    assert torch.equal(zero.scores, metagradients(run, make_model("linear"), loss_fn, batcher(data), QUERIES,
                                                  query_loss, train_ids=list(range(12))).scores)


def test_a_truncated_pass_equals_finite_differences_of_the_runs_it_models(tmp_path):
    """Re-runs with one example's weight at 1 +- h from step K on (``replay(weights_from=K)``)."""
    from gradtrace.replay import replay

    data = make_data()
    run, _ = _record(tmp_path, "mlp", "adamw_cosine_clip", data)
    model, start, h = make_model("mlp"), 5, 1e-4
    got = metagradients(run, model, loss_fn, batcher(data), QUERIES, query_loss, train_ids=list(range(12)),
                        options=MetagradOptions(start_step=start))
    from gradtrace.replay.step import StepFunction

    forward_of = StepFunction(run, model, loss_fn, batcher(data)).forward
    fd = []
    for i in (0, 5, 11):
        losses = []
        for sign in (1, -1):
            state = replay(run, model, loss_fn, batcher(data), weights={i: 1 + sign * h}, weights_from=start).state
            forward = forward_of(state.params)
            with torch.no_grad():
                losses.append(torch.stack([query_loss(forward, q) for q in QUERIES]))
        fd.append((losses[0] - losses[1]) / (2 * h))
    assert _rel(-got.scores[:, [0, 5, 11]], torch.stack(fd, dim=1)) <= 1e-5


def test_a_start_step_beyond_the_run_is_refused(tmp_path):
    from gradtrace.replay.spec import ReplayError

    data = make_data()
    run, _ = _record(tmp_path, "linear", "sgd_momentum_wd", data)
    total = len(run.steps)
    with pytest.raises(ReplayError, match=rf"start_step={total}: the run has {total} optimizer step\(s\).*"
                                          rf"0 <= start_step < {total}"):
        metagradients(run, make_model("linear"), loss_fn, batcher(data), QUERIES, query_loss,
                      options=MetagradOptions(start_step=total))
    with pytest.raises(ValueError, match="start_step"):
        MetagradOptions(start_step=-1)
