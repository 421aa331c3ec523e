"""Bad input is refused with a clear error: optimizers, models, ids, losses, the recording protocol."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradtrace.replay import Reduction, ReplayError, RunRecorder, load_run, metagradients, replay

from .reference import query_loss
from .tasks import MLP, batcher, loss_fn, make_data, make_model, schedule, train


@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.RMSprop(p), "cannot replay optimizer RMSprop"),
    (lambda p: type("MySGD", (torch.optim.SGD,), {})(p, lr=0.1), "cannot replay optimizer MySGD"),
    (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad=True is not supported"),
])
def test_unsupported_optimizers_are_refused(tmp_path, make, match):
    model = make_model("mlp")
    with pytest.raises(ReplayError, match=match):
        RunRecorder(tmp_path / "run", model, make(model.parameters()))


def test_random_or_stateful_layers_are_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 3)).double()
    with pytest.raises(ReplayError, match=r"dropout with p=0\.1 in training mode"):
        RunRecorder(tmp_path / "a", model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.eval()  # eval-mode dropout is the identity: accepted
    RunRecorder(tmp_path / "b", model, torch.optim.SGD(model.parameters(), lr=0.1))
    norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ReplayError, match="batch-norm"):
        RunRecorder(tmp_path / "c", norm, torch.optim.SGD(norm.parameters(), lr=0.1))


def test_the_recording_protocol_is_checked(tmp_path):
    model = make_model("linear")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = RunRecorder(tmp_path / "run", model, opt, accumulation=2)
    with pytest.raises(ReplayError, match=r"0 optimizer\.step"):
        rec.step([[0], [1]])
    model(torch.zeros(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    with pytest.raises(ReplayError, match="expected accumulation=2"):
        rec.step([0, 1])
    rec.step([[0], [1]])
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ReplayError, match="hyper-parameters changed"):
        opt.step()
    with pytest.raises(ReplayError, match="already holds a recorded run"):
        rec.finish(model)
        RunRecorder(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_resumed_optimizer_is_refused(tmp_path):
    model = make_model("linear")
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    with pytest.raises(ReplayError, match="already holds state"):
        RunRecorder(tmp_path / "run", model, opt)


@pytest.fixture()
def recorded(tmp_path):
    data = make_data()
    train(make_model("mlp"), "sgd", schedule(), data, record=tmp_path / "run")
    return load_run(tmp_path / "run"), data


def test_a_mismatched_model_is_refused(recorded):
    run, data = recorded
    with pytest.raises(ReplayError, match=r"fc1\.weight has shape"):
        replay(run, MLP(hidden=5).double(), loss_fn, batcher(data))
    with pytest.raises(ReplayError, match="missing parameters"):
        replay(run, make_model("linear"), loss_fn, batcher(data))
    with pytest.raises(ReplayError, match="is float32, recorded float64"):
        replay(run, make_model("mlp", torch.float32), loss_fn, batcher(data))


def test_missing_ids_are_refused(recorded):
    run, data = recorded
    partial = {i: data[i] for i in range(6)}
    with pytest.raises(ReplayError, match="batches\\(ids\\) failed at step 0"):
        replay(run, make_model("mlp"), loss_fn, batcher(partial))
    with pytest.raises(ReplayError, match="not in train_ids"):
        metagradients(run, make_model("mlp"), loss_fn, batcher(data), [data[0]], query_loss, train_ids=[0, 1])


def test_bad_losses_are_refused(recorded):
    run, data = recorded
    with pytest.raises(ReplayError, match="per-example losses of shape \\[4\\]"):
        replay(run, make_model("mlp"), lambda f, b: loss_fn(f, b).mean(), batcher(data))
    with pytest.raises(ReplayError, match="scalar loss"):
        metagradients(run, make_model("mlp"), loss_fn, batcher(data), [batcher(data)([0, 1])], loss_fn)
    with pytest.raises(ReplayError, match=r"no manifest\.json"):
        load_run(run.run_dir / "nowhere")
    with pytest.raises(ReplayError, match="kind='token_mean'"):
        Reduction(num_items_in_batch=True)
