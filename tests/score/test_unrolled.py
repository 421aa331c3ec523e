"""Unrolled influence over checkpoints (``gradtrace.Unrolled``): against the dense formula built from the fitted
eigendata in float64, its two limits (one long segment = the member's influence; a short one = TracIn's gradient
products) and the derivative of gradient descent's final query loss through the unrolled steps of a quadratic."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.fit.curvature import Curvature
from gradtrace.fit.curvature.blocks import DenseBlock
from gradtrace.fit.curvature.curvature import DenseEigen, KronEigen
from gradtrace.fit.methods import MissingStage
from gradtrace.fit.methods.influence import GGN
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions
from gradtrace.score.ensemble import EnsembleError
from tests.score.test_ensemble import _adam_run, _data, _trainer_directories

EPS = torch.finfo(torch.float32).eps


def _collect(models, batches, queries, projection=None):
    trains = [gradtrace.collect(m, batches, classification_loss,
                                options=CaptureOptions(projection=projection)) for m in models]
    return trains, gradtrace.collect(models[-1], queries, classification_loss,
                                     options=CaptureOptions(projection=projection))


def _layout(eig, offsets):
    """The flat (spec-layout) index of every entry of a block's bias-augmented gradient matrix, row-major."""
    block = eig.block
    if isinstance(eig, DenseEigen):
        start, stop = offsets[block.name]
        return torch.arange(start, stop)
    w0, _ = offsets[block.name]
    rows, cols = block.n_rows, block.n_cols
    index = torch.arange(w0, w0 + rows * cols).reshape(rows, cols)
    if block.bias is not None:
        b0, b1 = offsets[block.bias]
        bias = torch.arange(b0, b1)
        index = torch.cat([index, bias[:, None]], 1) if block.act_side == "cols" else torch.cat([index, bias[None]], 0)
    return index.reshape(-1)


def _dense(curvature, horizons):
    """Float64 ``D x D`` matrices from the eigendata: ``A = Q diag(t (lambda + damping)) Q^T`` and ``S = Q diag(t)
    Q^T``, ``t`` each block's horizon (one number, or one per eigen-direction), so that the segment's decay is
    ``exp(-A)`` and its response ``(I - exp(-A)) A^-1 S``."""
    dim = curvature.spec.dim
    rate, horizon = torch.zeros(dim, dim, dtype=torch.float64), torch.zeros(dim, dim, dtype=torch.float64)
    offsets = curvature.spec.offsets()
    for name, eig in curvature.blocks.items():
        if isinstance(eig, KronEigen):
            rows = eig.q_rows.double() if eig.q_rows is not None else torch.eye(eig.eigenvalues.shape[0]).double()
            cols = eig.q_cols.double() if eig.q_cols is not None else torch.eye(eig.eigenvalues.shape[1]).double()
            basis = torch.kron(rows, cols)
        else:
            basis = eig.q.double() if eig.q is not None else torch.eye(eig.eigenvalues.numel(), dtype=torch.float64)
        values = eig.eigenvalues.double().reshape(-1) + curvature.block_damping(name)
        t = torch.as_tensor(horizons[name], dtype=torch.float64).expand(eig.eigenvalues.shape).reshape(-1)
        index = _layout(eig, offsets)
        rate[index[:, None], index[None, :]] = basis @ torch.diag(t * values) @ basis.t()
        horizon[index[:, None], index[None, :]] = basis @ torch.diag(t) @ basis.t()
    return rate, horizon


def _reference(unrolled, trains, query):
    """``sum_c (F_c u_c)^T g_i^(c)`` in float64 with matrix exponentials, and the float32 bound of the method's
    result: every prepared query passes through at most ``2 C`` eigenbasis rotations and the product sums ``D``
    terms, each a float32 rounding of relative size ``eps`` per term (Higham's ``gamma_n``), and the filters'
    sensitivity to the eigenvalues' float32 rounding is at most ``1 + t (lambda + damping)``."""
    count = len(trains)
    carried = query.vectors.double()
    total, bound = 0, 0
    for c in range(count - 1, -1, -1):
        curvature = unrolled.members[c].method.active()
        rate, horizon = _dense(curvature, unrolled.horizons()[c])
        exponent = torch.linalg.matrix_exp(-rate)
        prepared = (torch.eye(len(rate), dtype=torch.float64) - exponent) @ torch.linalg.solve(rate, horizon)
        part = (carried @ prepared.t()) @ trains[c].vectors.double().t()
        total = total + part
        stiffness = 1 + float(torch.linalg.eigvalsh(rate).max())
        size = (carried @ prepared.t()).norm(dim=1)[:, None] * trains[c].vectors.double().norm(dim=1)[None, :]
        bound = bound + (2 * count + 2) * len(rate) * EPS * stiffness * size
        carried = carried @ exponent.t()
    return total, bound


def _step_scale(state, params, kind):
    """Adam's step scale ``P = 1 / (sqrt(v_hat) + eps)`` over the given parameter indices of a ``state_dict``:
    ``tr(P V) / tr(V)`` (``"trace"``) or ``mean(P)``."""
    group = state["param_groups"][0]
    moments = [state["state"][i]["exp_avg_sq"].double() / (1 - group["betas"][1] ** float(state["state"][i]["step"]))
               for i in params]
    v_hat = torch.cat([m.reshape(-1) for m in moments])
    step = 1 / (v_hat.sqrt() + group["eps"])
    return float((v_hat * step).sum() / v_hat.sum()) if kind == "trace" else float(step.mean())


CURVATURES = [("ekfac", None), ("kfac", None), ("ggn", None), ("logra", gradtrace.LoGra(rank=2, seed=1))]


@pytest.mark.parametrize(("method", "projection"), CURVATURES, ids=[m for m, _ in CURVATURES])
def test_equals_the_dense_formula_with_each_checkpoints_adam_state(method, projection):
    batches, queries = _data()
    models, states = _adam_run(3)
    trains, query = _collect(models, batches, queries, projection)
    # each layer's step scale comes from Adam's 1 / (sqrt(v_hat) + eps) over the layer (weight and bias) at its own
    # checkpoint (float64 sums of float32 states: rel 1e-6 is ~1000x their round-off)
    order = [name for name, _ in models[0].named_parameters()]  # Adam's order
    for kind in ("mean", "trace"):
        fitted = gradtrace.Unrolled(method, trains, steps=[3, 3, 3], lr=0.05, step_scale=kind)
        fitted.fit(None, batches, classification_loss, models=models, optimizers=states)
        for scales, state, member in zip(fitted.scales, states, fitted.members):
            blocks = member.method.active().blocks.values()
            assert scales.keys() == {eig.block.name for eig in blocks}
            for eig in blocks:
                want = _step_scale(state, [order.index(p) for p in eig.block.params], kind)
                assert scales[eig.block.name] == pytest.approx(want, rel=1e-6)
        assert fitted.scales[0] != fitted.scales[2]
    step_scale = "eigenbasis" if method in ("kfac", "logra") else "trace"  # one scale per direction too
    unrolled = gradtrace.Unrolled(method, trains, steps=[3, 3, 3], lr=0.05, block_rows=4, step_scale=step_scale)
    unrolled.fit(None, batches, classification_loss, models=models, optimizers=states)
    scores = unrolled.score(query, topk=None, matrix=True)
    want, bound = _reference(unrolled, trains, query)
    gap = (scores.matrix.double() - want).abs()
    assert bool((gap <= bound).all()), f"gap {float(gap.max()):.3g}, bound {float(bound.min()):.3g}"
    assert float(want.abs().max()) > 100 * float(bound.max())  # the check is not vacuous
    assert scores.meta["unrolled"]["optimizer"] == "adam" and scores.meta["unrolled"]["steps"] == [3, 3, 3]
    # streamed top-k in blocks of 4 rows: the top-k of the same scores
    top = unrolled.score(query, topk=3, matrix=False).topk(3, True)
    values, index = torch.topk(want, 3, dim=1)
    assert top.ids == [[trains[0].ids[j] for j in row] for row in index.tolist()]
    assert bool(((top.values.double() - values).abs() <= bound.gather(1, index)).all())


def test_a_long_segment_is_influence_and_a_short_one_is_tracin():
    batches, queries = _data()
    models, _ = _adam_run(1)
    trains, query = _collect(models, batches, queries)
    single = gradtrace.Attributor("ekfac", trains[0]).fit(models[0], batches, classification_loss)
    influence = single.score(query, topk=None, matrix=True).matrix.double()
    long = gradtrace.Unrolled("ekfac", trains, steps=[1], lr=1e12).fit(models[0], batches, classification_loss,
                                                                       optimizers="sgd")
    got = long.score(query, topk=None, matrix=True).matrix.double()
    q = single.method.prepare_queries(query.vectors).double()
    gemm = 2 * trains[0].dim * EPS * q.norm(dim=1)[:, None] * trains[0].vectors.double().norm(dim=1)[None, :]
    assert bool(((got - influence).abs() <= gemm).all())
    t = 1e-6
    short = gradtrace.Unrolled("ekfac", trains, steps=[1], lr=t).fit(models[0], batches, classification_loss,
                                                                     optimizers="sgd")
    got = short.score(query, topk=None, matrix=True).matrix.double() / t
    dots = query.vectors.double() @ trains[0].vectors.double().t()
    curvature = short.members[0].method.active()
    largest = max(float(e.eigenvalues.max()) + curvature.block_damping(n) for n, e in curvature.blocks.items())
    sizes = query.vectors.double().norm(dim=1)[:, None] * trains[0].vectors.double().norm(dim=1)[None, :]
    # (1 - exp(-t x)) / x = t (1 - t x / 2 + ...): relative deviation at most t * largest / 2, plus float32 round-off
    assert bool(((got - dots).abs() <= (t * largest + 4 * trains[0].dim * EPS) * sizes).all())


class _Linear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 1, bias=False)

    def forward(self, inputs):
        return self.fc(inputs).squeeze(-1)


def _squared(model, batch):
    return 0.5 * (model(batch["inputs"]) - batch["targets"]).square()


def test_gradient_descent_on_a_quadratic_is_unrolled_exactly_to_first_order():
    """Full-batch GD on least squares (constant Hessian ``H = X^T X / N``), one checkpoint per step (its start): the
    scores equal ``-N d f_q(theta_T) / d w_i`` (``w_i``: example ``i``'s loss weight) from autograd through the steps,
    up to the continuous-time limit of each step, ``x = eta lambda <= 0.005``: the response ``(1 - exp(-x)) / lambda``
    is ``eta`` within a relative ``x / 2``, the decay ``exp(-x)`` is ``1 - x`` within ``x^2 / 2`` per later step; over
    ``T = 100`` steps the decay reaches ``exp(-0.5)``, so carrying the query back matters (TracIn's undecayed sum is
    checked to miss)."""
    torch.manual_seed(0)
    n, dim, steps, x_max = 40, 4, 100, 0.005
    x, y = torch.randn(n, dim, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    qx, qy = torch.randn(3, dim, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    hessian = x.t() @ x / n
    lr = x_max / float(torch.linalg.eigvalsh(hessian).max())
    weights = torch.ones(n, dtype=torch.float64, requires_grad=True)
    theta = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    path = []
    for _ in range(steps):
        path.append(theta.detach().clone())
        loss = (weights * 0.5 * (x @ theta - y).square()).mean()
        theta = theta - lr * torch.autograd.grad(loss, theta, create_graph=True)[0]
    query_loss = 0.5 * (qx @ theta - qy).square()
    want = torch.stack([-n * torch.autograd.grad(query_loss[k], weights, retain_graph=True)[0] for k in range(3)])

    ids = [f"ex{i}" for i in range(n)]
    batches = [{"inputs": x[i:i + 16].float(), "targets": y[i:i + 16].float(), "id": ids[i:i + 16]}
               for i in range(0, n, 16)]
    models, trains = [], []
    for point in path:
        model = _Linear(dim)
        with torch.no_grad():
            model.fc.weight.copy_(point[None].float())
        models.append(model)
        trains.append(gradtrace.collect(model, batches, _squared))
    final = _Linear(dim)
    with torch.no_grad():
        final.fc.weight.copy_(theta.detach()[None].float())
    query = gradtrace.collect(final, [{"inputs": qx.float(), "targets": qy.float(), "id": ["q0", "q1", "q2"]}],
                              _squared)
    values, vectors = torch.linalg.eigh(hessian)
    block = DenseEigen(DenseBlock("fc.weight", dim), vectors.float().contiguous(), values.float())
    exact = [GGN(curvature=Curvature("fisher", train.spec, {"fc.weight": block}, "exact", 0.0, "absolute"))
             for train in trains]
    unrolled = gradtrace.Unrolled(exact, trains, steps=[1] * steps, lr=lr)
    unrolled.fit(optimizers="sgd")
    got = unrolled.score(query, topk=None, matrix=True).matrix.double()
    magnitude = sum(lr * query.vectors.double().norm(dim=1)[:, None] * t.vectors.double().norm(dim=1)[None, :]
                    for t in trains)
    # twice the first-order deviations, plus float32 gradients and eigendata (D = 4, 100 terms): 1e-5
    bound = (x_max + steps * x_max ** 2 + 1e-5) * magnitude
    assert bool(((got - want).abs() <= bound).all()), f"{float(((got - want).abs() / bound).max()):.3g}"
    assert float(want.abs().max()) > 50 * float(bound.max())
    tracin = sum(lr * query.vectors.double() @ t.vectors.double().t() for t in trains)
    assert bool(((tracin - want).abs() > bound).any())


def test_bad_input_is_refused_with_the_fix():
    batches, queries = _data()
    models, states = _adam_run(2)
    trains, query = _collect(models, batches, queries)
    with pytest.raises(EnsembleError, match=r"1 values of steps for 2 checkpoints"):
        gradtrace.Unrolled("ekfac", trains, steps=[3], lr=0.05)
    with pytest.raises(EnsembleError, match=r"steps of segment 1 must be a positive integer, got 2.5"):
        gradtrace.Unrolled("ekfac", trains, steps=[3, 2.5], lr=0.05)
    with pytest.raises(EnsembleError, match=r"lr of segment 0 must be positive and finite"):
        gradtrace.Unrolled("ekfac", trains, steps=[3, 3], lr=[-1.0, 0.1])
    with pytest.raises(EnsembleError, match=r"step_scale must be one of \('trace', 'eigenbasis', 'mean'\), got 'med"):
        gradtrace.Unrolled("ekfac", trains, steps=[3, 3], lr=0.05, step_scale="median")
    with pytest.raises(EnsembleError, match=r"needs a curvature method .* got 'grad_dot'"):
        gradtrace.Unrolled("grad_dot", trains, steps=[3, 3], lr=0.05)
    unrolled = gradtrace.Unrolled("ekfac", trains, steps=[3, 3], lr=0.05)
    with pytest.raises(MissingStage, match=r"optimizers='sgd' for plain SGD"):
        unrolled.fit(None, batches, classification_loss, models=models)
    with pytest.raises(EnsembleError, match=r"a list of one Adam state per checkpoint"):
        unrolled.fit(None, batches, classification_loss, models=models, optimizers=states[0])
    with pytest.raises(EnsembleError, match=r"1 optimizer states for 2 checkpoints"):
        unrolled.fit(None, batches, classification_loss, models=models, optimizers=states[:1])
    with pytest.raises(MissingStage, match=r"ekfac needs curvature: run attr.fit"):
        unrolled.score(query)
    broken = copy.deepcopy(states)
    broken[1]["state"][2]["exp_avg_sq"][0, 0] = float("nan")
    with pytest.raises(EnsembleError, match=r"checkpoint 1: the Adam second moment .* \['fc2.weight'\] holds NaN"):
        unrolled.fit(None, batches, classification_loss, models=models, optimizers=broken)
    unrolled.fit(None, batches, classification_loss, models=models, optimizers=states)
    with pytest.raises(EnsembleError, match=r"takes one query set, at the attributed model"):
        unrolled.score([query, query])


def test_trainer_style_checkpoint_directories_give_the_same_scores(tmp_path):
    batches, queries = _data()
    models, states = _adam_run(2)
    trains, query = _collect(models, batches, queries)
    directories = _trainer_directories(tmp_path, models, states)
    given = gradtrace.Unrolled("ekfac", trains, steps=[3, 3], lr=0.05)
    given.fit(None, batches, classification_loss, models=models, optimizers=states)
    read = gradtrace.Unrolled("ekfac", trains, steps=[3, 3], lr=0.05)
    read.fit(models[0], batches, classification_loss, checkpoints=directories)
    assert read.scales == given.scales
    assert torch.equal(read.score(query, topk=None).matrix, given.score(query, topk=None).matrix)


def test_a_block_without_gradient_has_no_step_and_dead_coordinates_weigh_nothing():
    """``"trace"`` weighs coordinates by their second moment: one that never got a gradient (``v = 0``, ``P = 1 /
    eps``) does not change it, where it decides ``"mean"``; a block with no gradient at all never moved (``s = 0``).
    ``"eigenbasis"``: ``diag(Q^T P Q)`` per direction (a dense rotation, and a Kronecker one against its dense
    Kronecker product)."""
    from gradtrace.fit.curvature.blocks import KronBlock
    from gradtrace.fit.methods.less import AdamState
    from gradtrace.score.unrolled import segment_scales
    from gradtrace.store.spec import GradientSpec

    def state(values):
        moment = torch.tensor(values)
        return AdamState(torch.zeros_like(moment), moment, 10.0, 0.9, 0.999, 1e-8)

    correction = 1 - 0.999 ** 10
    live = [4e-4, 1e-4]
    rotation = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)))[0].contiguous()
    rows, cols = (torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(n)))[0].contiguous()
                  for n in (2, 3))
    blocks = {"a": DenseEigen(DenseBlock("a", 3), rotation, torch.ones(3)),
              "b": DenseEigen(DenseBlock("b", 2), None, torch.ones(2)),
              "w": KronEigen(KronBlock("w", 2, 2, "cols", "wb"), rows, cols, torch.ones(2, 3))}
    spec = GradientSpec(params=[("a", 3), ("b", 2), ("w", 4), ("wb", 2)], projection=None, convention={})
    curvature = Curvature("fisher", spec, blocks, "exact", 0.1, "relative")
    states = {"a": state([*live, 0.0]), "b": state([0.0, 0.0]), "w": state([live, live[::-1]]), "wb": state(live)}
    trace = segment_scales(curvature, states, "trace")
    v_hat = torch.tensor(live, dtype=torch.float64) / correction
    want = float((v_hat / (v_hat.sqrt() + 1e-8)).sum() / v_hat.sum())
    assert trace["a"] == pytest.approx(want, rel=1e-6) and trace["w"] == pytest.approx(want, rel=1e-6)
    assert trace["b"] == 0.0
    assert segment_scales(curvature, states, "mean")["a"] > 1e7  # the dead coordinate's 1 / eps decides the mean
    assert segment_scales(curvature, None) == {"a": 1.0, "b": 1.0, "w": 1.0}
    eigen = segment_scales(curvature, states, "eigenbasis")
    steps = {k: 1 / (bias_v.double().div(correction).sqrt() + 1e-8) for k, bias_v in
             ((k, v.exp_avg_sq) for k, v in states.items())}
    dense = rotation.double().t() @ torch.diag(steps["a"]) @ rotation.double()
    assert torch.allclose(eigen["a"], dense.diagonal(), rtol=1e-6, atol=0)
    matrix = torch.cat([steps["w"], steps["wb"][:, None]], 1)  # the bias joins as the last column
    basis = torch.kron(rows.double(), cols.double())
    want = (basis.t() @ torch.diag(matrix.reshape(-1)) @ basis).diagonal().reshape(2, 3)
    assert eigen["w"].shape == (2, 3) and torch.allclose(eigen["w"], want, rtol=1e-6, atol=0)
    assert torch.allclose(eigen["b"], steps["b"], rtol=1e-6, atol=0)  # sqrt(v) + eps is summed in float32


def test_a_trainer_runs_segments():
    """Steps between the chosen checkpoints and the mean learning rate over them, from the run's records."""
    from gradtrace.integrations.trainer_store import segments

    run = [{"step": 10, "mean_lr": 1.0, "updates": 10}, {"step": 20, "mean_lr": 0.5, "updates": 10},
           {"step": 30, "mean_lr": 0.25, "updates": 10}]
    assert segments(run) == ([10, 10, 10], [1.0, 0.5, 0.25])
    assert segments(run, [run[0], run[2]]) == ([10, 20], [1.0, 0.375])
    assert segments(run, [run[2]]) == ([30], [pytest.approx(1.75 / 3)])
    with pytest.raises(ValueError, match=r"steps \[25\] are not among the run's"):
        segments(run, [{"step": 25}])
    with pytest.raises(ValueError, match=r"must be in training order, got steps \[30, 10\]"):
        segments(run, [run[2], run[0]])
    partial = [run[0], {**run[1], "updates": 4}, run[2]]
    with pytest.raises(ValueError, match=r"learning rates for 14 updates between steps 0 and 20, which took 20"):
        segments(partial, [partial[1]])
