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
