"""Whole-model curvature (arnoldi, cg, ggn_full) against the dense Gauss-Newton matrix of all parameters, built here
from per-example Jacobians; the operators against explicit products; bad input."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import gradtrace
from gradtrace.fit.curvature import CurvatureError
from gradtrace.fit.curvature.hvp import EmpiricalFisherOperator, GGNOperator
from gradtrace.fit.methods import MissingStage
from gradtrace.fit.methods.whole_model import WHOLE_MODEL_DAMPING
from gradtrace.loss.functions import causal_lm_loss, classification_loss, regression_loss
from gradtrace.options import CaptureOptions
from gradtrace.store import SpecMismatch
from tests import tiny


def _classifier(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # 51 parameters
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]  # ragged batches
    queries = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    return model, batches, queries, x, y


def _dense_ggn(model, x, kind="cls"):
    """(1/N) sum_n J_n^T H_n J_n in float64, J_n the Jacobian of example n's outputs in all parameters."""
    model = copy.deepcopy(model).double()
    params = {n: p.detach() for n, p in model.named_parameters()}

    def outputs(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),))[0]

    total = 0
    for xi in x.double():
        jac = jacrev(outputs)(params, xi)
        J = torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in params], dim=1)  # [C, P]
        if kind == "cls":
            p = torch.softmax(outputs(params, xi), -1)
            H = torch.diag(p) - torch.outer(p, p)
        else:
            H = torch.eye(J.shape[0], dtype=torch.float64)
        total = total + J.t() @ H @ J
    return total / x.shape[0]


def _inverse(G, q, damping=0.1):
    lam = damping * torch.trace(G) / G.shape[0]
    return torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), q.double().t()).t(), lam


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method,options", [("cg", {}), ("arnoldi", {"rank": 51, "iterations": 51}),
                                            ("ggn_full", {})])
def test_whole_model_scores_equal_dense_ggn_inverse(method, options):
    model, batches, queries, x, _ = _classifier()
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor(method, train, precision="float64", **options)
    attr.fit(model, batches, classification_loss)
    got = attr.score(query).matrix
    G = _dense_ggn(model, x)
    solved, lam = _inverse(G, query.vectors, attr.method.damping)  # each method's default damping
    want = solved @ train.vectors.double().t()
    assert _rel(got, want) <= 1e-4
    assert attr.method.damping == (0.1 if method == "arnoldi" else WHOLE_MODEL_DAMPING)
    assert attr.method.options()["fisher"] == "exact"
    assert abs(attr.method.lam - float(lam)) <= 1e-5 * float(lam)  # float32 diagonal from label enumeration


def test_cg_float32_within_float32_accuracy():
    """float32 products: the error is bounded by the residual (tolerance and float32 rounding) times the condition
    number."""
    model, batches, queries, x, _ = _classifier(1)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor("cg", train).fit(model, batches, classification_loss)
    got = attr.method.prepare_queries(query.vectors)
    G = _dense_ggn(model, x)
    want, lam = _inverse(G, query.vectors, attr.method.damping)
    eig = torch.linalg.eigvalsh(G)
    cond = float((eig.max() + lam) / (eig.min().clamp(min=0) + lam))
    # relative error <= cond x relative residual: CG's stopping tolerance plus float32 rounding of the products
    assert _rel(got, want) <= cond * (attr.method.tol + 4 * torch.finfo(torch.float32).eps)


def test_arnoldi_low_rank_equals_truncated_eigendecomposition():
    model, batches, queries, x, _ = _classifier(2)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    G = _dense_ggn(model, x)
    values, vectors = torch.linalg.eigh(G)
    values, vectors = values.flip(0), vectors.flip(1)
    ratios = values[3:15] / values[4:16]
    rank = 4 + int(ratios.argmax())  # the cut with the widest gap: the top-r eigenspace is well defined
    assert values[rank - 1] > 1.5 * values[rank]
    lam = 0.1 * torch.trace(G) / G.shape[0]
    U = vectors[:, :rank]
    q = query.vectors.double()
    coords = q @ U
    truncated = q / lam + (coords * (1 / (values[:rank] + lam) - 1 / lam)) @ U.t()
    for iterations in (51, 30):  # a full Krylov basis, and fewer steps than parameters
        attr = gradtrace.Attributor("arnoldi", train, rank=rank, iterations=iterations, complement="damping",
                                    precision="float64")
        attr.fit(model, batches, classification_loss)
        assert torch.allclose(attr.method.eigenvalues, values[:rank], rtol=1e-6, atol=1e-10 * float(values[0]))
        assert _rel(attr.method.prepare_queries(query.vectors), truncated) <= 1e-4
    attr = gradtrace.Attributor("arnoldi", train, rank=rank, iterations=51, complement="zero", precision="float64")
    attr.fit(model, batches, classification_loss)
    assert _rel(attr.method.prepare_queries(query.vectors), (coords / (values[:rank] + lam)) @ U.t()) <= 1e-4
    # complement="mean": the complement scaled by 1 / (lambda + its mean eigenvalue), (trace - sum of the top) / (P - r)
    attr = gradtrace.Attributor("arnoldi", train, rank=rank, iterations=51, precision="float64")  # default: "mean"
    attr.fit(model, batches, classification_loss)
    assert attr.method.complement == "mean"
    tail = (torch.trace(G) - values[:rank].sum()) / (G.shape[0] - rank)
    assert abs(attr.method.tail_mean - float(tail)) <= 1e-5 * float(tail)  # float32 diagonal (label enumeration)
    shift = lam + tail
    want = q / shift + (coords * (1 / (values[:rank] + lam) - 1 / shift)) @ U.t()
    assert _rel(attr.method.prepare_queries(query.vectors), want) <= 1e-4
    with pytest.raises(ValueError, match="complement must be 'damping', 'mean' or 'zero'"):
        gradtrace.Attributor("arnoldi", train, complement="half")


def test_regression_ggn_and_empirical_fisher_products():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(9, 3), torch.randn(9, 2)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    params = [(n, p.numel()) for n, p in model.named_parameters()]
    op = GGNOperator(model, batches, regression_loss, params, precision="float64")
    v = torch.randn(3, op.dim, dtype=torch.float64)
    assert _rel(op.matmul(v), v @ _dense_ggn(model, x, kind="reg")) <= 1e-10
    train = gradtrace.collect(model, batches, regression_loss)
    fisher = EmpiricalFisherOperator(train, block_rows=4, precision="float64")
    g = train.vectors.double()
    assert _rel(fisher.matmul(v), v @ (g.t() @ g / 9)) <= 1e-10
    assert _rel(fisher.diagonal(), (g * g).mean(0)) <= 1e-10


def test_lm_ggn_products_sum_softmax_hessians_over_target_tokens():
    torch.manual_seed(4)
    model = tiny.gpt2(attn_implementation="eager")
    ids = torch.randint(1, tiny.VOCAB, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # padding: not a target
    batch = {"input_ids": ids, "attention_mask": mask}
    names = ["transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight", "transformer.wte.weight"]
    named = dict(model.named_parameters())
    op = GGNOperator(model, [batch], causal_lm_loss, [(n, named[n].numel()) for n in names], precision="float64")
    double = copy.deepcopy(model).double()
    params = {n: dict(double.named_parameters())[n].detach() for n in names}

    def logits(p):
        return functional_call(double, p, (), {"input_ids": ids, "attention_mask": mask}).logits

    jac = jacrev(logits)(params)  # [B, T, V, *shape]
    J = torch.cat([jac[n].reshape(3, 6, tiny.VOCAB, -1) for n in names], dim=3)
    probs = torch.softmax(logits(params), -1)
    labels = ids.masked_fill(mask == 0, -100)
    target = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], 1) != -100
    G = 0
    for b in range(3):
        for t in range(6):
            if target[b, t]:
                p = probs[b, t]
                G = G + J[b, t].t() @ (torch.diag(p) - torch.outer(p, p)) @ J[b, t]
    v = torch.randn(2, op.dim, dtype=torch.float64)
    assert _rel(op.matmul(v), v @ (G / 3)) <= 1e-8


def test_empirical_fisher_needs_no_model():
    model, batches, queries, _, _ = _classifier(5)
    train = gradtrace.collect(model, batches, classification_loss)
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor("ggn_full", train, fisher="empirical", precision="float64").fit()
    g = train.vectors.double()
    F_ = g.t() @ g / g.shape[0]
    want, _ = _inverse(F_, query.vectors, attr.method.damping)
    assert _rel(attr.method.prepare_queries(query.vectors), want) <= 1e-6


def test_bad_input_is_a_clear_error():
    model, batches, queries, _, _ = _classifier(6)
    train = gradtrace.collect(model, batches, classification_loss)
    with pytest.raises(CurvatureError, match=r"needs \(16 \+ 1 \+ 8\) x 51 x 4 bytes = .* max_bytes"):
        gradtrace.Attributor("arnoldi", train, rank=8, iterations=16, max_bytes=1000).fit(
            model, batches, classification_loss)
    with pytest.raises(CurvatureError, match="rank 60 exceeds the 51 captured parameters"):
        gradtrace.Attributor("arnoldi", train, rank=60).fit(model, batches, classification_loss)
    with pytest.raises(CurvatureError, match="ggn_full: the dense matrix of 51 parameters needs"):
        gradtrace.Attributor("ggn_full", train, max_params=50).fit(model, batches, classification_loss)
    projected = gradtrace.collect(model, batches, classification_loss,
                                  options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(ValueError, match="exact gradients over all captured parameters"):
        gradtrace.Attributor("cg", projected).fit(model, batches, classification_loss)
    with pytest.raises(MissingStage, match=r"needs attr.fit\(model, train_data, loss_fn\)"):
        gradtrace.Attributor("cg", train).fit()
    with pytest.raises(MissingStage, match=r"run attr\.fit"):
        gradtrace.Attributor("cg", train).score(train)
    with pytest.raises(ValueError, match="fisher must be 'auto', 'exact'"):
        gradtrace.Attributor("cg", train, fisher="true")

    def custom(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none") * 2

    with pytest.raises(ValueError, match="fisher='empirical'"):
        gradtrace.Attributor("cg", train, fisher="exact").fit(model, batches, custom)
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.raises(SpecMismatch, match="another model"):
        gradtrace.Attributor("cg", train).fit(other, batches, classification_loss)


def test_model_without_forward_mode_support_is_a_clear_error():
    model = tiny.gpt2()  # CPU scaled-dot-product attention has no forward-mode derivative
    ids = torch.randint(1, tiny.VOCAB, (2, 5))
    named = dict(model.named_parameters())
    op = GGNOperator(model, [{"input_ids": ids}], None, [("lm_head.weight" if "lm_head.weight" in named else
                                                          "transformer.wte.weight", tiny.VOCAB * 16)])
    with pytest.raises(CurvatureError, match="attn_implementation='eager'"):
        op.matmul(torch.randn(1, op.dim))
