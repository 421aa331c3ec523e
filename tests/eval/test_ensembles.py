"""The tasks' checkpoints along their own training run, and ensemble rows of the quality harness."""

import pytest
import torch

from gradtrace.eval import DigitsMLPTask, DigitsTask, MethodSpec, TinyLMTask, build_lds_ground_truth, evaluate
from gradtrace.eval.benchmark import ensemble_models
from gradtrace.options.eval import LDSOptions
from gradtrace.score.ensemble import EnsembleError


def _outputs(model, task):
    return model(task.x_test[:50])


def test_checkpoints_follow_the_tasks_own_run_and_end_at_its_model():
    task = DigitsMLPTask(num_train=60, num_queries=5, width=16, epochs=5, batch_size=16)
    seen = []
    task.train(torch.arange(task.num_train), 0, on_epoch=lambda epoch, model: seen.append(epoch))
    assert seen == [1, 2, 3, 4, 5]
    saved = task.checkpoints(2)  # after epochs round(2.5) = 2 and 5
    assert len(saved) == 2
    with torch.no_grad():
        assert torch.equal(_outputs(saved[-1], task), _outputs(task.model, task))  # the same run, bit for bit
        partial = task.train(torch.arange(task.num_train), 0)  # another run of 5 epochs is the same model...
        assert torch.equal(_outputs(partial, task), _outputs(saved[-1], task))
        early = DigitsMLPTask(num_train=60, num_queries=5, width=16, epochs=2, batch_size=16)
        # ...and checkpoint 0 is the run's state after 2 of its 5 epochs (the batch order depends only on the seed)
        assert torch.equal(_outputs(saved[0], task), _outputs(early.model, early))
    with pytest.raises(ValueError, match=r"count must be an integer in 1\.\.5"):
        task.checkpoints(6)
    with pytest.raises(ValueError, match="no epoch schedule"):
        DigitsTask(num_train=30, num_queries=5, steps=2).checkpoints(2)


def test_late_checkpoints_span_the_second_half_of_the_same_run():
    task = DigitsMLPTask(num_train=60, num_queries=5, width=16, epochs=6, batch_size=16)
    seen = []

    def remember(epoch, model):
        seen.append((epoch, _outputs(model, task).detach().clone()))

    task.train(torch.arange(task.num_train), 0, on_epoch=remember)
    late = ensemble_models(task, "late_checkpoints", 2)  # after epoch 3: epochs 3 + round(1.5) = 5 and 6
    with torch.no_grad():
        assert [torch.equal(_outputs(m, task), seen[4][1]) for m in late] == [True, False]
        assert torch.equal(_outputs(late[1], task), seen[5][1])
        assert torch.equal(_outputs(late[1], task), _outputs(task.model, task))
    assert len(task.checkpoints(3, after=0.5)) == 3  # epochs 4, 5, 6
    with pytest.raises(ValueError, match=r"count must be an integer in 1\.\.3 .*after epoch 3"):
        task.checkpoints(4, after=0.5)
    with pytest.raises(ValueError, match=r"after must be a fraction of the run in \[0, 1\)"):
        task.checkpoints(2, after=1.0)


def test_seed_ensembles_start_with_the_tasks_model():
    task = DigitsMLPTask(num_train=40, num_queries=5, width=8, epochs=2)
    models = ensemble_models(task, "seeds", 3)
    assert models[0] is task.model and len(models) == 3
    with torch.no_grad():
        assert not torch.equal(_outputs(models[1], task), _outputs(models[0], task))
    with pytest.raises(ValueError, match="ensemble must be one of"):
        ensemble_models(task, "bagging", 3)


def test_evaluate_scores_ensembles_on_tinylm():
    task = TinyLMTask(num_train=12, num_queries=3, epochs=2, batch_size=6, vocab_size=300, width=32)
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, config=task.config,
                                   options=LDSOptions(num_subsets=6))
    specs = [MethodSpec("kfac", ensemble="checkpoints", members=2, label="kfac x2"),
             MethodSpec("grad_dot", ensemble="seeds", members=2, label="dot x2")]
    rows = evaluate(task, specs, truth, batch_size=5)
    assert [row.method for row in rows] == ["kfac x2", "dot x2"]
    assert all(row.lds.per_query.shape == (3,) and row.members_seconds > 0 for row in rows)
    with pytest.raises(ValueError, match="as an ensemble 'bagging'"):
        evaluate(task, [MethodSpec("kfac", ensemble="bagging")], truth)


def _quality_harness():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["checkpoints", "late_checkpoints", "seeds"])
def test_the_harness_gives_each_trackstar_member_its_own_adam_state(kind):
    harness = _quality_harness()
    task = DigitsMLPTask(num_train=40, num_queries=4, width=8, epochs=4, batch_size=16)  # 3 Adam steps per epoch
    assert task.checkpoint_epochs(2) == [2, 4] and task.checkpoint_epochs(2, after=0.5) == [3, 4]
    states, why = harness.member_adam_states(task, kind, 2)
    assert why == "" and len(states) == 2
    epochs = {"checkpoints": [2, 4], "late_checkpoints": [3, 4], "seeds": [4, 4]}[kind]
    for state, epoch in zip(states, epochs):  # each state is the optimizer's after its member's last step
        assert {int(s["step"]) for s in state["state"].values()} == {3 * epoch}
    first = states[0]["state"][0]["exp_avg_sq"]
    assert not torch.equal(first, states[1]["state"][0]["exp_avg_sq"])
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, config=task.config,
                                   options=LDSOptions(num_subsets=6))
    spec = MethodSpec("trackstar", ensemble=kind, members=2, member_options=[{"optimizer": s} for s in states])
    (row,) = evaluate(task, [spec], truth, batch_size=16)
    assert row.lds.per_query.shape == (4,) and bool(torch.isfinite(row.lds.per_query).all())
    with pytest.raises(EnsembleError, match="optimizer= holds the state of one model's weights"):
        evaluate(task, [MethodSpec("trackstar", ensemble=kind, members=2, fit_options={"optimizer": states[0]})],
                 truth, batch_size=16)
