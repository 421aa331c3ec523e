"""DVEmb: the trajectory records the right steps and step sizes, the recursion equals the product formula, and the
embeddings predict the effect of retraining without an example where DVEmb's curvature model is exact."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.methods import MissingStage
from gradtrace.fit.methods.dvemb import data_value_embeddings
from gradtrace.loss.functions import regression_loss
from gradtrace.options import CaptureOptions, Loss
from gradtrace.train import TrajectoryWriter
from tests import tiny


def _data(n, seed, d=7, classes=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _schedule(n, sizes, epochs, seed=0):
    """Batches of example indices: each epoch a permutation cut into ``sizes`` (examples repeat across epochs)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm, start = torch.randperm(n, generator=gen).tolist(), 0
        for size in sizes:
            out.append(perm[start:start + size])
            start += size
    return out


def _product_formula(traj):
    """``sum_s (I - H_{T-1}) ... (I - H_{s+1}) w_s g_s(z)`` per row, with ``H_t = sum_rows w g g^T`` built densely."""
    grads = traj.read(0, len(traj)).double()
    steps = traj.field("step")
    weights = torch.tensor(traj.field("weight"), dtype=torch.float64)
    last = max(steps)
    hessians = {}
    for t in set(steps):
        rows = [r for r, s in enumerate(steps) if s == t]
        g = grads[rows]
        hessians[t] = g.t() @ (weights[rows, None] * g)
    out = torch.zeros_like(grads)
    for r in range(len(traj)):
        v = weights[r] * grads[r]
        for t in range(steps[r] + 1, last + 1):
            if t in hessians:
                v = v - hessians[t] @ v
        out[r] = v
    return out


def test_recursion_equals_the_product_formula(tmp_path):
    model = tiny.MLP()
    x, y = _data(6, seed=1)
    qx, qy = _data(3, seed=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    logra = gradtrace.LoGra(rank=2)
    writer = TrajectoryWriter(tmp_path / "trajectory", optimizer)
    schedule = _schedule(6, [3, 3], 1) + _schedule(6, [4, 2], 1, seed=1) + [[0, 5, 2]]
    with gradtrace.capture(model, loss=Loss(reduction="mean"), callbacks=[writer],
                           options=CaptureOptions(projection=logra)) as cap:
        for batch in schedule:
            cap.annotate(ids=[f"ex{i}" for i in batch])
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    traj = writer.result()
    sizes = [len(b) for b in schedule]
    lrs = [0.2, 0.2, 0.1, 0.1, 0.05]
    assert traj.field("example") == [f"ex{i}" for b in schedule for i in b]
    assert traj.field("step") == [t for t, s in enumerate(sizes) for _ in range(s)]
    assert traj.field("lr") == pytest.approx([lrs[t] for t, s in enumerate(sizes) for _ in range(s)])
    assert traj.field("weight") == pytest.approx([lrs[t] / s for t, s in enumerate(sizes) for _ in range(s)])
    assert traj.ids[:2] == [f"ex{schedule[0][0]}@0", f"ex{schedule[0][1]}@0"]

    want_rows = _product_formula(traj)
    rows = data_value_embeddings(traj, by="row")
    scale = want_rows.abs().max()
    assert (rows.vectors.double() - want_rows).abs().max() <= 1e-5 * scale
    for block_rows in (1, 4, 7):  # steps are processed in blocks of rows: the result does not depend on their size
        other = data_value_embeddings(traj, by="row", block_rows=block_rows)
        assert (other.vectors - rows.vectors).abs().max() <= 1e-6 * scale
    examples = data_value_embeddings(traj)
    assert examples.ids == list(dict.fromkeys(traj.field("example")))
    want = torch.stack([want_rows[[r for r, e in enumerate(traj.field("example")) if e == ident]].sum(0)
                        for ident in examples.ids])
    assert (examples.vectors.double() - want).abs().max() <= 1e-5 * scale
    assert examples.field("rows") == [traj.field("example").count(i) for i in examples.ids]

    queries = gradtrace.collect(model, [(qx, qy)], options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("dvemb", traj)
    with pytest.raises(MissingStage, match=r"attr\.fit"):
        attr.score(queries)
    scores = attr.fit().score(queries)
    assert scores.train_ids == examples.ids
    expected = queries.vectors.double() @ want.t()
    assert (scores.matrix.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    with pytest.raises(ValueError, match="already are data value embeddings"):
        attr.fit()
    attr.method.embeddings.save(tmp_path / "embeddings")
    again = gradtrace.Attributor("dvemb", tmp_path / "embeddings").score(queries)
    assert torch.equal(again.matrix, scores.matrix) and again.train_ids == scores.train_ids


def test_trajectory_counts_optimizer_steps_and_step_sizes_under_accumulation():
    model = tiny.MLP()
    x, y = _data(12, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = TrajectoryWriter(None, optimizer)
    params = dict(model.named_parameters())
    updates = []
    with gradtrace.capture(model, loss=Loss(reduction="mean", scale=0.5), callbacks=[writer]) as cap:
        for step in range(3):
            before = {n: p.detach().clone() for n, p in params.items()}
            for micro in range(2):
                batch = list(range(4 * step + 2 * micro, 4 * step + 2 * micro + 2))
                cap.annotate(ids=[f"ex{i}" for i in batch])
                (F.cross_entropy(model(x[batch]), y[batch]) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
            updates.append({n: (p.detach() - before[n]).reshape(-1) for n, p in params.items()})
    traj = writer.result()
    assert traj.field("step") == [0] * 4 + [1] * 4 + [2] * 4
    assert traj.field("backward") == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert traj.field("weight") == pytest.approx([0.05 / 4] * 12)  # lr / (batch size * accumulation steps)
    names = [n for n, _ in traj.spec.params]
    grads, weights, steps = traj.read(0, len(traj)), torch.tensor(traj.field("weight")), traj.field("step")
    for t, update in enumerate(updates):  # theta_{t+1} - theta_t = -sum_rows weight * g
        rows = [r for r, s in enumerate(steps) if s == t]
        predicted = -(weights[rows, None] * grads[rows]).sum(0)
        actual = torch.cat([update[n] for n in names])
        assert torch.allclose(predicted, actual, rtol=1e-4, atol=1e-7)


def _barrier(u, sign):
    """``-log(2 + sign * u)``: for a linear model its Hessian is exactly ``g g^T`` (DVEmb's curvature model)."""
    return -torch.log(2 + sign * u)


def _retrain(init, x, sign, schedule, lrs, row_weights, query):
    """SGD in float64 from ``init`` with per-row loss weights; returns the final query loss."""
    weight, bias = (init[k].double().clone().requires_grad_(True) for k in ("weight", "bias"))
    r = 0
    for batch, lr in zip(schedule, lrs):
        u = (x[batch].double() @ weight.t() + bias).squeeze(1)
        w = row_weights[r:r + len(batch)]
        r += len(batch)
        loss = (w * _barrier(u, sign[batch])).sum() / len(batch)
        gw, gb = torch.autograd.grad(loss, [weight, bias])
        with torch.no_grad():
            weight -= lr * gw
            bias -= lr * gb
    qx, qy = query
    with torch.no_grad():
        return float(0.5 * ((qx.double() @ weight.t() + bias).squeeze(1) - qy.double()).pow(2).sum())


def test_dvemb_predicts_retraining_when_its_curvature_is_exact():
    torch.manual_seed(3)
    n, d = 6, 4
    x = torch.randn(n, d) * 0.7
    sign = torch.tensor([1.0, -1.0] * (n // 2), dtype=torch.float64)
    query = (torch.randn(1, d), torch.randn(1) + 3)  # far from fitted: first-order terms dominate
    model = nn.Linear(d, 1)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    schedule = _schedule(n, [3, 3], 2, seed=4)
    lrs = [0.3, 0.2, 0.2, 0.1]
    optimizer = torch.optim.SGD(model.parameters(), lr=lrs[0])
    writer = TrajectoryWriter(None, optimizer)
    with gradtrace.capture(model, loss=Loss(reduction="mean"), callbacks=[writer]) as cap:
        for batch, lr in zip(schedule, lrs):
            optimizer.param_groups[0]["lr"] = lr
            cap.annotate(ids=[f"ex{i}" for i in batch])
            _barrier(model(x[batch]).squeeze(1), sign[batch].float()).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    traj = writer.result()
    qgrad = gradtrace.collect(model, [query], loss=regression_loss).vectors[0].double()
    predicted = data_value_embeddings(traj, by="row").vectors.double() @ qgrad  # [rows]
    ones = torch.ones(len(traj), dtype=torch.float64)
    base = _retrain(init, x, sign, schedule, lrs, ones, query)
    eps = 1e-4
    first_order, removal = [], []
    for r in range(len(traj)):
        up, down, gone = ones.clone(), ones.clone(), ones.clone()
        up[r], down[r], gone[r] = 1 + eps, 1 - eps, 0.0
        slope = (_retrain(init, x, sign, schedule, lrs, up, query)
                 - _retrain(init, x, sign, schedule, lrs, down, query)) / (2 * eps)
        first_order.append(-slope)  # removing = weight 1 -> 0
        removal.append(_retrain(init, x, sign, schedule, lrs, gone, query) - base)
    first_order = torch.tensor(first_order, dtype=torch.float64)
    removal = torch.tensor(removal, dtype=torch.float64)
    scale = first_order.abs().max()
    # exact to first order: the derivative of actual retraining in the example's weight at that step (measured
    # 5e-8 of the largest value; the trajectory is stored in float32)
    assert (predicted - first_order).abs().max() <= 1e-5 * scale
    # removing the example from that step entirely: what remains is second order in its step (measured 2.5%)
    assert (predicted - removal).abs().max() <= 0.05 * scale
    assert torch.corrcoef(torch.stack([predicted, removal]))[0, 1] > 0.999


def test_dvemb_refuses_stores_without_a_trajectory_and_large_dims(tmp_path):
    model = tiny.MLP()
    x, y = _data(4, seed=5)
    plain = gradtrace.collect(model, [(x, y)], store=tmp_path / "plain",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(MissingStage, match=r"'example'.*TrajectoryWriter"):
        gradtrace.Attributor("dvemb", plain).fit()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = TrajectoryWriter(None, optimizer)
    with gradtrace.capture(model, loss=Loss(reduction="mean"), callbacks=[writer]):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    with pytest.raises(ValueError, match=r"smaller LoGra rank.*fewer layers"):
        gradtrace.Attributor("dvemb", writer.result(), max_dim=64).fit()
