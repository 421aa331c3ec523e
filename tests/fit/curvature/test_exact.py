"""Each curvature approximation equals a dense implementation of the *same* formula, built independently
from brute-force per-example quantities (explicit Kronecker products, dense inverses)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.curvature import fit_curvature
from gradtrace.loss.functions import classification_loss, regression_loss
from gradtrace.options import CaptureOptions, FitOptions
from gradtrace.projection.logra import Projector


class TokenMLP(nn.Module):
    """Linear layers applied per token ([B, T, d]); the example's loss sums over its tokens."""

    def __init__(self, d_in=5, hidden=4, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def token_loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).sum(1)


def _data(n=12, t=3, d_in=5, classes=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, d_in, generator=gen)
    y = torch.randint(0, classes, (n, t), generator=gen)
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, n, 4)], x, y


def _brute_factors(model, x, y, module):
    """Per example and token: input activation a_t and output-gradient s_t of ``module``, by autograd."""
    acts, grads = [], []
    for i in range(x.shape[0]):
        store = {}
        h = module.register_forward_hook(lambda m, inp, out, store=store: store.update(a=inp[0], out=out))
        logits = model(x[i:i + 1])
        h.remove()
        loss = F.cross_entropy(logits.flatten(0, 1), y[i].flatten(), reduction="sum")
        (s,) = torch.autograd.grad(loss, store["out"])
        acts.append(store["a"][0].detach())
        grads.append(s[0])
    return torch.stack(acts), torch.stack(grads)  # [N, T, d_in], [N, T, d_out]


def _dense_kfac_inverse(acts, grads, bias, query, damping=0.1, ekfac=False):
    """Dense (G + lambda I)^-1 q for a Linear weight (+ bias column), from explicit Kronecker matrices."""
    n, t = acts.shape[:2]
    if bias:
        acts = torch.cat([acts, torch.ones(n, t, 1)], dim=2)
    live = grads.abs().sum(-1) > 0
    a = acts[live].double()
    s = grads[live].double()
    tokens = a.shape[0]
    A = a.t() @ a / tokens
    S = s.t() @ s / tokens
    if not ekfac:
        G = torch.kron(S, A) * (tokens / n)
        lam = damping * torch.linalg.eigvalsh(G).clamp(min=0).mean()
    else:
        eS, QS = torch.linalg.eigh(S)
        eA, QA = torch.linalg.eigh(A)
        per_example = torch.einsum("ntr,ntc->nrc", grads.double(), acts.double())  # [N, d_out, d_in(+1)]
        lam_grid = (QS.t() @ per_example @ QA).pow(2).mean(0)
        Q = torch.kron(QS, QA)
        G = Q @ torch.diag(lam_grid.reshape(-1)) @ Q.t()
        lam = damping * lam_grid.mean()
    return torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), query.double().t()).t()


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_kfac_and_ekfac_equal_dense_kronecker_inverse(kind):
    torch.manual_seed(0)
    model = TokenMLP()
    batches, x, y = _data()
    curvature = fit_curvature(model, batches, token_loss, fit_options=FitOptions(kind=kind, fisher="empirical"))
    assert set(curvature.blocks) == {"fc1.weight", "fc2.weight"}  # fc1.bias joined into fc1's block
    query = torch.randn(2, curvature.spec.dim)
    got = curvature.apply_inverse(query)
    offsets = curvature.spec.offsets()
    for module, name, bias in ((model.fc1, "fc1.weight", "fc1.bias"), (model.fc2, "fc2.weight", None)):
        acts, grads = _brute_factors(model, x, y, module)
        w0, w1 = offsets[name]
        d_out, d_in = module.weight.shape
        q = query[:, w0:w1].reshape(2, d_out, d_in)
        if bias:
            b0, b1 = offsets[bias]
            q = torch.cat([q, query[:, b0:b1].unsqueeze(2)], dim=2)
        want = _dense_kfac_inverse(acts, grads, bias is not None, q.reshape(2, -1), ekfac=(kind == "ekfac"))
        want = want.reshape(2, d_out, -1).float()
        assert torch.allclose(got[:, w0:w1].reshape(2, d_out, d_in), want[:, :, :d_in], rtol=1e-3, atol=1e-4)
        if bias:
            assert torch.allclose(got[:, b0:b1], want[:, :, d_in], rtol=1e-3, atol=1e-4)


def test_dense_ggn_exact_fisher_equals_label_enumeration():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    curvature = fit_curvature(model, batches, classification_loss,
                              fit_options=FitOptions(kind="fisher", fisher="exact"))
    params = dict(model.named_parameters())
    for name, eig in curvature.blocks.items():
        dim = params[name].numel()
        fisher = torch.zeros(dim, dim, dtype=torch.float64)
        for i in range(10):
            probs = torch.softmax(model(x[i:i + 1]), -1)[0].detach()
            for c in range(3):
                model.zero_grad()
                F.cross_entropy(model(x[i:i + 1]), torch.tensor([c])).backward()
                g = params[name].grad.reshape(-1).double()
                fisher += probs[c] * torch.outer(g, g)
        fisher /= 10
        rebuilt = eig.q.double() @ torch.diag(eig.eigenvalues.double()) @ eig.q.double().t()
        assert torch.allclose(rebuilt, fisher, rtol=1e-4, atol=1e-6), name


def test_kfac_is_exact_ggn_on_linear_regression():
    """One linear layer with a squared error: the Gauss-Newton matrix is E[a a^T] (x) I, so K-FAC (exact Fisher)
    and the dense GGN give the same influence scores. (No bias: K-FAC joins a bias into the weight's block,
    the per-parameter dense GGN keeps them apart.)"""
    torch.manual_seed(2)
    model = nn.Linear(6, 3, bias=False)
    x, y = torch.randn(40, 6), torch.randn(40, 3)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    train = gradtrace.collect(model, batches, regression_loss)
    queries = gradtrace.collect(model, [(torch.randn(5, 6), torch.randn(5, 3))], regression_loss)
    scores = {}
    for method in ("kfac", "ekfac", "ggn"):
        attr = gradtrace.Attributor(method, train, fisher="exact", damping=1e-3)
        attr.fit(model, batches, regression_loss)
        scores[method] = attr.score(queries).matrix
    scale = float(scores["ggn"].abs().max())
    assert torch.allclose(scores["kfac"], scores["ggn"], atol=1e-4 * scale)
    assert torch.allclose(scores["ekfac"], scores["ggn"], atol=1e-4 * scale)


def test_logra_influence_equals_dense_projected_fisher_inverse():
    torch.manual_seed(3)
    from tests import tiny

    model = tiny.gpt2()
    ids = torch.randint(1, tiny.VOCAB, (24, 9))
    batches = [{"input_ids": ids[i:i + 8]} for i in range(0, 16, 8)]
    logra = gradtrace.LoGra(rank=3)
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=logra))
    queries = gradtrace.collect(model, [{"input_ids": ids[16:]}], options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("logra", train)
    attr.fit()
    got = attr.score(queries).matrix
    # reference: exact gradients, projected explicitly, dense Fisher per parameter, dense inverse
    exact_train = gradtrace.collect(model, batches)
    exact_query = gradtrace.collect(model, [{"input_ids": ids[16:]}])
    projector = Projector(logra)
    shapes = dict(model.named_parameters())
    want = torch.zeros(8, 16, dtype=torch.float64)
    offsets = exact_train.spec.offsets()
    for name, (start, stop) in offsets.items():
        shape = tuple(shapes[name].shape)
        g = projector.project_full(name, exact_train.vectors[:, start:stop].reshape(-1, *shape), shape).double()
        q = projector.project_full(name, exact_query.vectors[:, start:stop].reshape(-1, *shape), shape).double()
        fisher = g.t() @ g / g.shape[0]
        lam = 0.1 * torch.linalg.eigvalsh(fisher).clamp(min=0).mean()
        want += torch.linalg.solve(fisher + lam * torch.eye(fisher.shape[0], dtype=torch.float64), q.t()).t() @ g.t()
    assert torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
