"""States recorded during the run (``RunRecorder(keep_states=N)``): they are the replay's states bit for bit, and a
truncated pass or a weighted replay that starts from one gives the scores of one that replays from the start."""

from __future__ import annotations

import json

import pytest
import torch

from gradtrace.options import MetagradOptions
from gradtrace.replay import load_run, metagradients, replay
from gradtrace.replay.spec import ReplayError
from gradtrace.replay.step import StepFunction

from .reference import query_loss
from .tasks import batcher, loss_fn, make_data, make_model, schedule, train

QUERIES = list(make_data(n=3, seed=7).values())
RECIPES = {"adamw_clip_accumulation": ("adamw", 2, 0.5, 3), "sgd_momentum": ("sgd", 1, None, None),
           "foreach_adam": ("adam", 1, 1.0, 2)}


def _record(path, recipe, keep_states=None):
    optimizer, accumulation, clip, warmup = RECIPES[recipe]
    train(make_model("mlp"), optimizer, schedule(accumulation=accumulation), make_data(), accumulation=accumulation,
          grad_clip=clip, warmup=warmup, record=path, keep_states=keep_states,
          foreach=recipe == "foreach_adam")
    return load_run(path)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_recorded_states_are_the_replays_states(tmp_path, recipe):
    run = _record(tmp_path / "run", recipe, keep_states=2)
    total = len(run.steps)
    assert sorted(run.states) == list(range(2, total, 2))  # not the state after the last step: final.safetensors
    assert sorted(p.name for p in (tmp_path / "run" / "states").iterdir()) == [
        f"step-{t:08d}.safetensors" for t in range(2, total, 2)]  # nor its file (9 steps: 8 kept, 9 % 2 != 0)
    steps = StepFunction(run, make_model("mlp"), loss_fn, batcher(make_data()))
    state = steps.initial_state()
    for t in range(total):
        if t in run.states:
            recorded = run.state(t, "cpu")
            assert recorded.counts == state.counts
            mine, theirs = dict(recorded.tensors()), dict(state.tensors())
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), \
                {k: float((mine[k] - theirs[k]).abs().max()) for k in mine}
        state = steps.step(t, state)


@pytest.mark.parametrize("recipe", ["adamw_clip_accumulation", "sgd_momentum"])
def test_a_truncated_pass_from_a_recorded_state_gives_the_same_scores(tmp_path, recipe, monkeypatch):
    data = make_data()
    plain = _record(tmp_path / "plain", recipe)
    kept = _record(tmp_path / "kept", recipe, keep_states=3)
    args = (make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss)
    calls = []
    real = StepFunction.step

    def counted(self, t, state, weights=None, create_graph=False):
        calls.append((t, create_graph))
        return real(self, t, state, weights, create_graph)

    monkeypatch.setattr(StepFunction, "step", counted)
    for start in (4, 6):
        options = MetagradOptions(start_step=start)
        a = metagradients(plain, *args, train_ids=list(range(12)), options=options)
        calls.clear()
        b = metagradients(kept, *args, train_ids=list(range(12)), options=options)
        assert a.replayed_from == 0 and b.replayed_from == 3 * (start // 3)
        assert torch.equal(a.scores, b.scores) and b.replay_difference == 0.0
        forward = [t for t, graph in calls if not graph]
        assert min(forward) == b.replayed_from  # the forward replay began at the recorded state
    whole = metagradients(kept, *args, train_ids=list(range(12)))  # start_step 0: from the initial weights
    assert whole.replayed_from == 0


def test_a_weighted_replay_from_a_recorded_state_is_the_same_run(tmp_path):
    data = make_data()
    plain = _record(tmp_path / "plain", "adamw_clip_accumulation")
    kept = _record(tmp_path / "kept", "adamw_clip_accumulation", keep_states=2)
    weights = {3: 0.0, 7: 2.5}
    a = replay(plain, make_model("mlp"), loss_fn, batcher(data), weights=weights, weights_from=5).state
    b = replay(kept, make_model("mlp"), loss_fn, batcher(data), weights=weights, weights_from=5).state
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    checked = replay(kept, make_model("mlp"), loss_fn, batcher(data))  # the check itself still replays from 0
    assert checked.difference == 0.0


def test_a_damaged_or_missing_state_is_refused_naming_its_step(tmp_path):
    run = _record(tmp_path / "run", "sgd_momentum", keep_states=4)
    path = run.states[4]
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ReplayError, match=r"state recorded before step 4 .* cannot be read"):
        metagradients(run, make_model("mlp"), loss_fn, batcher(make_data()), QUERIES, query_loss,
                      options=MetagradOptions(start_step=5))
    path.unlink()
    with pytest.raises(ReplayError, match=r"lists a state recorded before step 4, and .*step-00000004.safetensors "
                                          r"is missing"):
        load_run(tmp_path / "run")


def test_a_state_of_another_model_is_refused(tmp_path):
    from gradtrace.replay.weights import write_tensors

    run = _record(tmp_path / "run", "sgd_momentum", keep_states=4)
    write_tensors(run.states[4].with_suffix(""), {"param/fc1.weight": torch.zeros(2, 2, dtype=torch.float64)})
    with pytest.raises(ReplayError, match=r"before step 4 .*fc1.weight has shape \[2, 2\], the run's parameter "
                                          r"\[6, 4\]"):
        run.state(4, "cpu")
    write_tensors(run.states[4].with_suffix(""), {"slot/fc1.weight/exp_avg": torch.zeros(6, 4)})
    with pytest.raises(ReplayError, match=r"holds 'slot/fc1.weight/exp_avg', which is not a state of this run's sgd"):
        run.state(4, "cpu")


def test_keep_states_is_checked_and_recorded_in_the_manifest(tmp_path):
    from gradtrace.replay import RunRecorder

    model = make_model("mlp")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ReplayError, match="keep_states"):
            RunRecorder(tmp_path / f"bad{bad}", model, torch.optim.SGD(model.parameters(), lr=0.1),
                        keep_states=bad)
    run = _record(tmp_path / "run", "sgd_momentum", keep_states=5)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["states"] == {"every": 5, "steps": [5]}
    last = _record(tmp_path / "last", "sgd_momentum", keep_states=3)  # 9 steps: the state before step 9 is final's
    assert sorted(last.states) == [3, 6] and not (tmp_path / "last" / "states" / "step-00000009.safetensors").exists()
    assert sorted(run.states) == [5]
    run.cast(torch.float32)  # a run replayed in another precision reads its states in that precision
    assert run.state(5, "cpu").params["fc1.weight"].dtype == torch.float32
