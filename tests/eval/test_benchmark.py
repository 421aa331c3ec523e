"""``evaluate`` end to end on digits: grad_dot's LDS is clearly positive, random's is not; method wiring."""

import pytest
import torch

import gradtrace
from gradtrace.eval import GroundTruth, MethodSpec, evaluate, format_table, unsupported
from gradtrace.fit.methods import base as method_registry
from gradtrace.fit.methods.similarity import GradDot


def test_grad_dot_beats_random_on_digits(digits_task, digits_ground_truth):
    rows = evaluate(digits_task, ["grad_dot", ("grad_cos", {}), "random"], digits_ground_truth)
    by_name = {row.method: row for row in rows}
    assert list(by_name) == ["grad_dot", "grad_cos", "random"]
    dot, rand = by_name["grad_dot"], by_name["random"]
    assert dot.lds_mean > 0.3 and dot.lds_mean > 5 * dot.lds_se
    assert abs(rand.lds_mean) < 0.1
    assert by_name["grad_cos"].lds_mean > 0.1
    assert dot.lds.per_query.shape == (digits_task.num_queries,) and dot.seconds >= 0 and dot.collect_seconds > 0
    table = format_table(rows)
    assert "| `grad_dot` |" in table and f"{dot.lds_mean:.3f} ± {dot.lds_se:.3f}" in table


class _FittedDot(GradDot):
    """grad_dot that records what fit() received and refuses to score before it."""

    name = "test_fitted_dot"

    def __init__(self, scale: float = 1.0):
        self.scale, self.fitted = scale, None

    def fit(self, attributor, model, data, loss_fn, projection=None, damping=0.0):
        self.fitted = {"model": model, "batches": list(data), "loss_fn": loss_fn, "projection": projection,
                       "damping": damping}
        _FittedDot.last = self

    def check_ready(self):
        if self.fitted is None:
            raise gradtrace.fit.methods.MissingStage("fit first")

    def prepare_queries(self, queries, checkpoint=0):
        return queries * self.scale


@pytest.fixture
def fitted_method():
    method_registry.register_method(_FittedDot)
    yield _FittedDot
    method_registry._METHODS.pop(_FittedDot.name)


def test_methods_that_need_fitting_are_fitted(digits_task, digits_ground_truth, fitted_method):
    spec = MethodSpec("test_fitted_dot", {"scale": 2.0}, fit_options={"damping": 0.1}, label="fitted")
    projection = gradtrace.LoGra(rank=4)
    rows = evaluate(digits_task, [spec, "grad_dot"], digits_ground_truth, projection=projection)
    fitted = fitted_method.last.fitted
    assert fitted["model"] is digits_task.model and fitted["loss_fn"] is digits_task.loss_fn
    assert fitted["projection"] is projection and fitted["damping"] == 0.1
    assert sum(len(b["id"]) for b in fitted["batches"]) == digits_task.num_train
    assert rows[0].method == "fitted" and rows[0].options == {"scale": 2.0}
    assert rows[0].lds_mean == pytest.approx(rows[1].lds_mean)  # scaling does not change ranks
    with pytest.raises(ValueError, match="no fit"):
        evaluate(digits_task, [MethodSpec("grad_dot", fit=True)], digits_ground_truth)


def test_unsupported_methods_and_mismatched_ground_truth(digits_task, digits_ground_truth):
    assert unsupported("grad_dot") is None and unsupported("random") is None
    assert "unknown" in unsupported("no_such_method")
    assert "checkpoints" in unsupported("tracin")
    with pytest.raises(ValueError, match="no_such_method"):
        evaluate(digits_task, ["no_such_method"], digits_ground_truth)
    other = GroundTruth(digits_ground_truth.masks, digits_ground_truth.outcomes,
                        {"settings": {"config": {**digits_task.config, "version": -1}}})
    with pytest.raises(ValueError, match="another task configuration"):
        evaluate(digits_task, ["grad_dot"], other)
    with pytest.raises(ValueError, match="queries"):
        evaluate(digits_task, ["grad_dot"], GroundTruth(digits_ground_truth.masks, torch.zeros(24, 3)))
    assert MethodSpec.parse(("grad_cos", {"a": 1})).title == "grad_cos(a=1)"


def test_evaluate_runs_on_tinylm():
    from gradtrace.eval import TinyLMTask, build_lds_ground_truth
    from gradtrace.options.eval import LDSOptions

    task = TinyLMTask(num_train=12, num_queries=3, epochs=2, batch_size=6, vocab_size=300, width=32)
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, config=task.config,
                                   options=LDSOptions(num_subsets=6))
    rows = evaluate(task, ["grad_dot", "random"], truth, batch_size=5)
    assert [row.method for row in rows] == ["grad_dot", "random"]
    assert rows[0].lds.per_query.shape == (3,)
    assert rows[0].dim == sum(p.numel() for p in task.model.parameters())  # exact gradients of every parameter


def test_pca_projections_with_different_bases_get_their_own_gradients(digits_task, digits_ground_truth):
    """LoGra's equality ignores a PCA basis: the harness must not reuse one basis's gradients for another."""
    task = digits_task
    batches = task.train_batches(250)
    first = gradtrace.LoGra.pca(task.model, batches, task.loss_fn, rank=4)
    second = gradtrace.LoGra.pca(task.model, batches[:1], task.loss_fn, rank=4)  # another basis
    assert first == second and first.to_dict() != second.to_dict()
    rows = evaluate(task, [MethodSpec("grad_dot", projection=p, label=str(i)) for i, p in enumerate((first, second))]
                    + [MethodSpec("grad_dot", projection=first, label="again")], digits_ground_truth)
    want = [evaluate(task, ["grad_dot"], digits_ground_truth, projection=p)[0].lds_mean for p in (first, second)]
    assert [r.lds_mean for r in rows] == pytest.approx([want[0], want[1], want[0]])
    assert rows[0].lds_mean != rows[1].lds_mean
