"""TRAK against a direct computation from the paper's formula: margin gradients by brute force (one backward pass
per example), projected explicitly, the kernel Phi^T Phi and its damped inverse in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.curvature import CurvatureError
from gradtrace.fit.methods import MissingStage
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions
from gradtrace.projection.logra import Projector
from tests import tiny


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, inputs):
        return self.fc2(torch.tanh(self.fc1(inputs)))


def _setup(seed=0):
    torch.manual_seed(seed)
    model = Net()
    x, y = torch.randn(30, 5) * 2, torch.randint(0, 3, (30,))
    ids = [f"ex{i}" for i in range(30)]
    batches = [{"inputs": x[i:i + 8], "labels": y[i:i + 8], "id": ids[i:i + 8]} for i in range(0, 30, 8)]
    qx, qy = torch.randn(4, 5), torch.randint(0, 3, (4,))
    queries = [{"inputs": qx, "labels": qy}]
    return model, batches, queries, x, y, qx, qy


def _margin_grads(model, x, y):
    """Per example: the gradient of TRAK's margin log(p / (1 - p)) and 1 - p, by autograd (float64)."""
    model = model.double()
    rows, complement = [], []
    for xi, yi in zip(x.double(), y):
        logits = model(xi.unsqueeze(0))[0]
        others = torch.cat([logits[:yi], logits[yi + 1:]])
        margin = logits[yi] - torch.logsumexp(others, 0)
        grads = torch.autograd.grad(margin, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
        complement.append(1 - torch.softmax(logits.detach(), 0)[yi])
    model.float()
    return torch.stack(rows), torch.stack(complement)


def _project(model, rows, logra):
    """Explicit LoGra projection of flat per-example vectors (parameter by parameter)."""
    projector = Projector(logra)
    out, start = [], 0
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        part = rows[:, start:start + param.numel()].reshape(-1, *shape).float()
        out.append(projector.project_full(name, part, shape).reshape(rows.shape[0], -1).double())
        start += param.numel()
    return torch.cat(out, 1)


def _trak(phi_train, complement_train, phi_query, damping=0.1):
    kernel = phi_train.t() @ phi_train
    lam = damping * torch.linalg.eigvalsh(kernel).clamp(min=0).mean()
    solved = torch.linalg.solve(kernel + lam * torch.eye(kernel.shape[0], dtype=kernel.dtype), phi_query.t()).t()
    return solved @ (phi_train * complement_train[:, None]).t()


@pytest.mark.parametrize("projected", [False, True])
def test_trak_equals_the_paper_formula(projected):
    model, batches, queries, x, y, qx, qy = _setup()
    logra = gradtrace.LoGra(rank=2, seed=3) if projected else None
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("trak", train).fit(model, batches, classification_loss)
    got = attr.score(query).matrix.double()
    phi, comp = _margin_grads(model, x, y)
    phi_q, comp_q = _margin_grads(model, qx, qy)
    if projected:
        phi, phi_q = _project(model, phi, logra), _project(model, phi_q, logra)
    want = _trak(phi, comp, phi_q)
    # gradtrace omits TRAK's positive per-query factor 1 / (1 - p_q): scores are TRAK's times (1 - p_q)
    want = want * comp_q[:, None]
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    assert attr.method.options()["reweighted"] is True


def test_trak_matches_ids_and_refuses_other_data():
    model, batches, queries, *_ = _setup(1)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    shuffled = list(reversed(batches))  # matched by id, not by order
    a = gradtrace.Attributor("trak", train).fit(model, batches, classification_loss).score(query).matrix
    b = gradtrace.Attributor("trak", train).fit(model, shuffled, classification_loss).score(query).matrix
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
    with pytest.raises(ValueError, match=r"lacks 8 training examples of the store \(e.g. \['ex0'"):
        gradtrace.Attributor("trak", train).fit(model, batches[1:], classification_loss)
    no_ids = [{k: v for k, v in b.items() if k != "id"} for b in batches]
    with pytest.raises(ValueError, match="has 22 examples, the store 30"):
        gradtrace.Attributor("trak", train).fit(model, no_ids[1:], classification_loss)
    with pytest.raises(MissingStage, match="reweight=False"):
        gradtrace.Attributor("trak", train).fit()
    with pytest.raises(MissingStage, match=r"run attr\.fit"):
        gradtrace.Attributor("trak", train).score(query)
    with pytest.raises(CurvatureError, match=r"kernel of 57-dimensional gradients takes .* max_dim=40"):
        gradtrace.Attributor("trak", train, max_dim=40, mode="primal").fit(model, batches, classification_loss)
    with pytest.raises(CurvatureError, match=r"Gram matrix of 30 training examples takes .* max_dim=20"):
        gradtrace.Attributor("trak", train, max_dim=20).fit(model, batches, classification_loss)  # auto: dual
    singular = gradtrace.Attributor("trak", train, damping=0.0, reweight=False).fit()
    with pytest.raises(CurvatureError, match="singular"):  # 30 examples, 57 dimensions
        singular.score(query)


def test_trak_on_a_language_model_has_no_reweighting():
    torch.manual_seed(2)
    model = tiny.gpt2()
    ids = torch.randint(1, tiny.VOCAB, (12, 7))
    batches = [{"input_ids": ids[i:i + 4]} for i in range(0, 8, 4)]
    logra = gradtrace.LoGra(rank=2)
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, [{"input_ids": ids[8:]}], options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("trak", train).fit(model, batches)
    assert attr.method.options()["reweighted"] is False
    g, q = train.vectors.double(), query.vectors.double()
    want = _trak(g, torch.ones(len(g), dtype=torch.float64), q)
    got = attr.score(query).matrix.double()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    with pytest.raises(ValueError, match="defined for classifiers"):
        gradtrace.Attributor("trak", train, reweight=True).fit(model, batches)
    store_only = gradtrace.Attributor("trak", train, reweight=False).fit().score(query).matrix
    fitted = attr.score(query).matrix  # the same float32 kernel from the same rows: only BLAS paths may differ
    torch.testing.assert_close(store_only, fitted, rtol=1e-5, atol=1e-5 * float(fitted.abs().max()))


def test_probability_complement_is_exact_for_confident_examples():
    """``1 - p`` from ``-expm1(-loss)`` keeps the loss's relative precision. A float32 loss of a confident
    example is already 0 (log(e^20 + 1) rounds to 20), so this runs the forward in float64."""
    from gradtrace.fit.methods.trak import correct_class_complement

    model = nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[20.0, 0.0], [0.0, 0.0]]))
    x, y = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([0])
    got = correct_class_complement(model, [(x, y)], lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
                                   ["a"])
    # 1 - p = 2.06e-9 (an absolute tolerance would accept anything): the float64 log-sum-exp at magnitude 20 is
    # exact to ~20 eps64 = 4e-15 absolute, 2e-6 relative
    want = torch.tensor([1 / (1 + torch.exp(torch.tensor(20.0, dtype=torch.float64)))], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("reweight", [True, False])
def test_the_dual_form_equals_the_primal_one(reweight):
    """Woodbury: (Phi^T Phi + lambda I)^-1 = (I - Phi^T (Phi Phi^T + lambda I)^-1 Phi) / lambda with the same relative
    lambda (the mean of Phi^T Phi's D eigenvalues = trace / D), so the N x N Gram matrix gives TRAK's scores exactly;
    'auto' takes it when N < D. Self-influence too (its rows go through the same query transform)."""
    model, batches, queries, *_ = _setup(4)
    train = gradtrace.collect(model, batches, classification_loss)  # 30 examples, 57 dimensions
    query = gradtrace.collect(model, queries, classification_loss)
    fit = {"model": model, "data": batches, "loss_fn": classification_loss} if reweight else {}
    options = {"reweight": reweight}
    primal = gradtrace.Attributor("trak", train, mode="primal", block_rows=7, **options).fit(**fit)
    dual = gradtrace.Attributor("trak", train, block_rows=7, **options).fit(**fit)  # blocks of 7: a ragged Gram
    assert (primal.method.mode_used, dual.method.mode_used) == ("primal", "dual")
    assert dual.method.lam == pytest.approx(primal.method.lam, rel=1e-9)
    want = primal.score(query, matrix=True).matrix.double()
    got = dual.score(query, matrix=True).matrix.double()
    # both in float64 to the prepared queries (condition number <= 1 + D / 0.1 = 571), then float32 products of
    # 57 terms: well within 1e-5 of the largest score
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(dual.self_scores().double(), primal.self_scores().double(), rtol=1e-5, atol=0)
    # more examples than dimensions: auto keeps the primal kernel
    logra = gradtrace.LoGra(rank=2, seed=0)
    projected = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    assert projected.spec.dim < 30
    assert gradtrace.Attributor("trak", projected, reweight=False).fit().method.mode_used == "primal"
