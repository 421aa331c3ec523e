"""The metasmoothness check: re-runs along a random weight direction against the metagradient prediction."""

from __future__ import annotations

import torch

from gradtrace.options import MetagradOptions
from gradtrace.replay import load_run, metagradients, metasmoothness, replay

from .reference import query_loss
from .tasks import batcher, loss_fn, make_data, make_model, schedule, train

QUERIES = list(make_data(n=4, seed=7).values())


def test_weighted_replay_is_the_weighted_loop(tmp_path):
    data, steps = make_data(), schedule()
    train(make_model("mlp"), "adamw", steps, data, grad_clip=0.5, warmup=3, record=tmp_path / "run")
    weights = {3: 0.0, 7: 2.5}
    real = train(make_model("mlp"), "adamw", steps, data, grad_clip=0.5, warmup=3,
                 weights={i: torch.tensor(w, dtype=torch.float64) for i, w in weights.items()})
    state = replay(load_run(tmp_path / "run"), make_model("mlp"), loss_fn, batcher(data), weights=weights).state
    assert all(torch.equal(p.detach(), state.params[n]) for n, p in real.named_parameters())


def test_a_smooth_run_is_predicted_to_first_order(tmp_path):
    data = make_data()
    train(make_model("mlp"), "sgd", schedule(), data, record=tmp_path / "run")
    run = load_run(tmp_path / "run")
    args = (run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    report = metasmoothness(*args, result=metagradients(*args), options=MetagradOptions(scales=(1e-4, 1e-3, 1e-1)))
    assert report.actual.shape == (3, 4)
    assert report.relative_error[0] < 1e-3 and report.sign_agreement[:2] == [1.0, 1.0]
    ratio = report.relative_error[1] / report.relative_error[0]
    assert 3 < ratio < 30  # the error is the quadratic term: ~10x per decade of eps
    assert "rel. error" in report.table()


def test_a_truncated_pass_is_checked_against_the_runs_it_models(tmp_path):
    """With start_step the re-runs perturb the weights from that step on: the linear prediction holds to first order
    there, while the same scores against re-runs perturbed throughout (the whole run's function) do not."""
    data = make_data()
    train(make_model("mlp"), "sgd", schedule(), data, record=tmp_path / "run")
    run = load_run(tmp_path / "run")
    args = (run, make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    options = MetagradOptions(start_step=5, scales=(1e-4, 1e-3))
    truncated = metagradients(*args, options=options)
    report = metasmoothness(*args, result=truncated, options=options)
    assert report.relative_error[0] < 1e-3 and 3 < report.relative_error[1] / report.relative_error[0] < 30
    assert metasmoothness(*args, options=options).relative_error == report.relative_error  # computed with options
    late = replay(run, make_model("mlp"), loss_fn, batcher(data), weights={3: 2.0}, weights_from=5).state
    throughout = replay(run, make_model("mlp"), loss_fn, batcher(data), weights={3: 2.0}).state
    never = replay(run, make_model("mlp"), loss_fn, batcher(data), weights={3: 2.0}, weights_from=len(run.steps))
    assert not torch.equal(late.params["fc1.weight"], throughout.params["fc1.weight"])
    assert never.difference is None and all(torch.equal(p, run.final[n]) for n, p in never.state.params.items())
    whole = metasmoothness(*args, result=type(truncated)(truncated.scores, truncated.ids, truncated.query_losses,
                                                         truncated.replay_difference, truncated.checkpoint_every),
                           options=options)
    assert whole.relative_error[0] > 1e-2  # the early steps' effect is what the truncation leaves out
