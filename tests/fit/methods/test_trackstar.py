"""TrackStar against a hand computation: per-example gradients by brute force (one backward pass per example, float64),
divided by sqrt(v_hat) + eps from the Adam optimizer's own state, unit-normalised (or preconditioned), cosines."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.fit.methods import MissingStage
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions
from gradtrace.projection.logra import Projector
from tests.fit.methods.test_trak import Net


def _setup(seed=0, amsgrad=False):
    """A model trained 5 Adam steps (so the optimizer holds a second moment), its data and queries."""
    torch.manual_seed(seed)
    model = Net()
    x, y = torch.randn(30, 5) * 2, torch.randint(0, 3, (30,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.95), amsgrad=amsgrad)
    for _ in range(5):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    batches = [{"inputs": x[i:i + 8], "labels": y[i:i + 8]} for i in range(0, 30, 8)]
    qx, qy = torch.randn(4, 5), torch.randint(0, 3, (4,))
    return model, optimizer, batches, [{"inputs": qx, "labels": qy}], x, y, qx, qy


def _grads(model, x, y):
    """``[N, P]`` per-example cross-entropy gradients by autograd, float64."""
    model = model.double()
    rows = []
    for xi, yi in zip(x.double(), y):
        loss = F.cross_entropy(model(xi.unsqueeze(0)), yi.unsqueeze(0))
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]))
    model.float()
    return torch.stack(rows)


def _v_hat(model, optimizer):
    """Per parameter: Adam's bias-corrected second moment, float64."""
    group = optimizer.param_groups[0]
    out = []
    for param in model.parameters():
        state = optimizer.state[param]
        second = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        out.append(second.double() / (1 - group["betas"][1] ** float(state["step"])))
    return out


def _cos(a, b):
    return (a / a.norm(dim=1, keepdim=True)) @ (b / b.norm(dim=1, keepdim=True)).t()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_trackstar_equals_the_hand_computation_on_exact_gradients(amsgrad):
    model, optimizer, batches, queries, x, y, qx, qy = _setup(amsgrad=amsgrad)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor("trackstar", train).fit(model, optimizer=optimizer)
    got = attr.score(query).matrix.double()
    denominator = torch.cat([v.sqrt().reshape(-1) for v in _v_hat(model, optimizer)]) + 1e-8
    want = _cos(_grads(model, qx, qy) / denominator, _grads(model, x, y) / denominator)
    # float32 gradients and norms of O(1) cosines: a few hundred eps32
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    # the optimizer's state_dict gives the same numbers
    again = gradtrace.Attributor("trackstar", train).fit(model, optimizer=optimizer.state_dict())
    torch.testing.assert_close(again.score(query).matrix, got.float(), rtol=0, atol=1e-6)


def test_trackstar_on_logra_gradients_maps_the_second_moment_into_the_projection():
    model, optimizer, batches, queries, x, y, qx, qy = _setup(1)
    logra = gradtrace.LoGra(rank=2, seed=3)
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    got = gradtrace.Attributor("trackstar", train).fit(model, optimizer=optimizer).score(query).matrix.double()
    projector = Projector(logra)
    parts, denominators, start = {"train": [], "query": []}, [], 0
    raw = {"train": _grads(model, x, y), "query": _grads(model, qx, qy)}
    for (name, param), v in zip(model.named_parameters(), _v_hat(model, optimizer)):
        shape, size = tuple(param.shape), param.numel()
        for side, rows in raw.items():
            part = rows[:, start:start + size].reshape(-1, *shape).float()
            parts[side].append(projector.project_full(name, part, shape).double())
        if len(shape) == 1:  # diag(P diag(v) P^T) = (P * P) v
            moment = projector.matrix(name, "vector", shape[0]).double().square() @ v
        else:  # diag((C kron R) diag(vec V) (C kron R)^T) = (R * R) V (C * C)^T
            rows_m = projector.matrix(name, "rows", shape[0]).double()
            cols_m = projector.matrix(name, "cols", shape[1]).double()
            moment = rows_m.square() @ v @ cols_m.square().t()
        denominators.append(moment.reshape(-1).sqrt() + 1e-8)
        start += size
    denominator = torch.cat(denominators)
    want = _cos(torch.cat(parts["query"], 1) / denominator, torch.cat(parts["train"], 1) / denominator)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_trackstar_autocorrelation_preconditioning_equals_the_hand_computation():
    model, optimizer, batches, queries, x, y, qx, qy = _setup(2)
    logra = gradtrace.LoGra(rank=2, seed=1)
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", damping=0.1)
    attr.fit(model, optimizer=optimizer)
    got = attr.score(query).matrix.double()
    denominator = attr.method.denominator.double()
    train_n, query_n = train.vectors.double() / denominator, query.vectors.double() / denominator
    kernel = train_n.t() @ train_n
    lam = 0.1 * torch.linalg.eigvalsh(kernel).clamp(min=0).mean()
    inverse = torch.linalg.inv(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64))
    # cos(R^-1/2 n_q, R^-1/2 n_i) = n_q^T R^-1 n_i / (||n_q||_R ||n_i||_R)
    norm_q = ((query_n @ inverse) * query_n).sum(1).sqrt()
    norm_i = ((train_n @ inverse) * train_n).sum(1).sqrt()
    want = (query_n @ inverse @ train_n.t()) / norm_q[:, None] / norm_i[None, :]
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    assert float(got.abs().max()) <= 1 + 1e-5


@pytest.mark.parametrize("projected", [False, True])
def test_trackstar_autocorrelation_per_parameter_is_the_block_diagonal_hand_computation(projected):
    """``structure="parameter"``: ``R = blockdiag(N_p^T N_p + lambda_p I)``, each block damped by its own mean
    eigenvalue, cross-parameter terms dropped (Bergson's per-module autocorrelation)."""
    model, optimizer, batches, queries, x, y, qx, qy = _setup(3)
    logra = gradtrace.LoGra(rank=2, seed=2) if projected else None
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", structure="parameter",
                                damping=0.1)
    attr.fit(model, optimizer=optimizer)
    got = attr.score(query).matrix.double()
    denominator = attr.method.denominator.double()
    train_n, query_n = train.vectors.double() / denominator, query.vectors.double() / denominator
    inverse = torch.zeros(train.spec.dim, train.spec.dim, dtype=torch.float64)
    for start, stop in train.spec.offsets().values():
        part = train_n[:, start:stop]
        kernel = part.t() @ part
        lam = 0.1 * torch.linalg.eigvalsh(kernel).clamp(min=0).mean()
        eye = torch.eye(stop - start, dtype=torch.float64)
        inverse[start:stop, start:stop] = torch.linalg.inv(kernel + lam * eye)
    assert len(train.spec.params) == 4 and len(attr.method.vectors) == 4  # two weights, two biases
    norm_q = ((query_n @ inverse) * query_n).sum(1).sqrt()
    norm_i = ((train_n @ inverse) * train_n).sum(1).sqrt()
    want = (query_n @ inverse @ train_n.t()) / norm_q[:, None] / norm_i[None, :]
    # as the joint test: float32 gradients and their normalisation, O(1) cosines
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    joint = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", damping=0.1)
    joint.fit(model, optimizer=optimizer)
    assert float((joint.score(query).matrix.double() - got).abs().max()) > 1e-3  # another metric indeed


def test_trackstar_structure_refusals():
    model, optimizer, batches, *_ = _setup(4)
    train = gradtrace.collect(model, batches, classification_loss)
    with pytest.raises(ValueError, match="structure must be one of joint, parameter"):
        gradtrace.Attributor("trackstar", train, precondition="autocorrelation", structure="layer")
    with pytest.raises(ValueError, match="applies with precondition='autocorrelation' only"):
        gradtrace.Attributor("trackstar", train, structure="parameter")
    widest = max(train.spec.params, key=lambda p: p[1])
    attr = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", structure="parameter",
                                max_dim=widest[1] - 1)
    with pytest.raises(gradtrace.fit.curvature.CurvatureError, match=f"parameter {widest[0]} "):
        attr.fit(model, optimizer=optimizer)
    joint = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", max_dim=train.spec.dim - 1)
    with pytest.raises(gradtrace.fit.curvature.CurvatureError, match="use structure='parameter'"):
        joint.fit(model, optimizer=optimizer)


def test_trackstar_with_a_curvature_method_uses_its_inverse_as_the_metric():
    model, optimizer, batches, queries, *_ = _setup(3)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor("trackstar", train, precondition="kfac")
    attr.fit(model, batches, classification_loss, optimizer=optimizer)
    got = attr.score(query).matrix.double()
    kfac = attr.method.curvature
    denominator = attr.method.denominator
    train_n, query_n = train.vectors / denominator, query.vectors / denominator
    pre_q, pre_i = kfac.prepare_queries(query_n).double(), kfac.prepare_queries(train_n).double()
    norm_q = (pre_q * query_n.double()).sum(1).sqrt()
    norm_i = (pre_i * train_n.double()).sum(1).sqrt()
    want = (pre_q @ train_n.double().t()) / norm_q[:, None] / norm_i[None, :]
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)


def test_trackstar_refuses_a_missing_adam_state(tmp_path):
    model, optimizer, batches, queries, *_ = _setup(4)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    with pytest.raises(MissingStage, match=r"optimizer=.*GradtraceCallback"):
        gradtrace.Attributor("trackstar", train).fit(model)
    with pytest.raises(MissingStage, match="Adam's second moment"):
        gradtrace.Attributor("trackstar", train).score(query)
    with pytest.raises(FileNotFoundError, match=r"optimizer\.pt"):
        gradtrace.Attributor("trackstar", train).fit(model, optimizer=tmp_path)
    fresh = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"has no Adam state .*not stepped"):
        gradtrace.Attributor("trackstar", train).fit(model, optimizer=fresh)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.zero_grad()
    F.cross_entropy(model(torch.randn(3, 5)), torch.tensor([0, 1, 2])).backward()
    sgd.step()
    with pytest.raises(ValueError, match="not an Adam state"):
        gradtrace.Attributor("trackstar", train).fit(model, optimizer=sgd)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")  # a Trainer checkpoint directory
    from_dir = gradtrace.Attributor("trackstar", train).fit(model, optimizer=tmp_path).score(query).matrix
    direct = gradtrace.Attributor("trackstar", train).fit(model, optimizer=optimizer).score(query).matrix
    torch.testing.assert_close(from_dir, direct, rtol=0, atol=1e-6)


def test_a_grouped_optimizer_state_is_matched_by_names_never_by_position():
    """A state dict of several parameter groups (the Trainer's weight-decay groups) lists parameters in group order,
    not the model's: without recorded names it is refused, with param_names= it equals the optimizer itself."""
    torch.manual_seed(5)
    model = Net()
    x, y = torch.randn(30, 5) * 2, torch.randint(0, 3, (30,))
    weights = [model.fc2.weight, model.fc1.weight]  # another order than the model's, as weight decay groups make
    biases = [model.fc2.bias, model.fc1.bias]
    optimizer = torch.optim.Adam([{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
                                 lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    batches = [{"inputs": x[i:i + 8], "labels": y[i:i + 8]} for i in range(0, 30, 8)]
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, [{"inputs": x[:4], "labels": y[:4]}], classification_loss)
    state = optimizer.state_dict()
    with pytest.raises(ValueError, match=r"2 parameter groups and records no parameter names.*param_names="):
        gradtrace.Attributor("trackstar", train).fit(model, optimizer=state)
    names = ["fc2.weight", "fc1.weight", "fc2.bias", "fc1.bias"]
    named = gradtrace.Attributor("trackstar", train).fit(model, optimizer=state, param_names=names)
    direct = gradtrace.Attributor("trackstar", train).fit(model, optimizer=optimizer)
    # the same second moment (the state dict holds the optimizer's own tensors), cosines of unit rows computed twice:
    # a float32 product of D terms each, so within 2 D eps32 whatever the BLAS kernel or thread count
    bound = 2 * train.spec.dim * torch.finfo(torch.float32).eps
    torch.testing.assert_close(named.score(query).matrix, direct.score(query).matrix, rtol=0, atol=bound)
