"""Curvature in use: language models (tied weights, projected space), saving and re-damping, bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.curvature import Curvature, CurvatureError, fit_curvature
from gradtrace.fit.methods import MissingStage
from gradtrace.options import CaptureOptions, FitOptions
from gradtrace.store import SpecMismatch
from tests import tiny


def _lm_data(model_seed=0, n=16, t=8):
    torch.manual_seed(model_seed)
    ids = torch.randint(1, tiny.VOCAB, (n + 4, t))
    return [{"input_ids": ids[i:i + 8]} for i in range(0, n, 8)], [{"input_ids": ids[n:]}]


@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=4)], ids=["exact", "logra"])
@pytest.mark.parametrize("fisher", ["empirical", "true"])
def test_ekfac_on_gpt2_with_tied_embeddings(projection, fisher):
    model = tiny.gpt2(tied=True)
    train_batches, query_batches = _lm_data()
    train = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=projection))
    queries = gradtrace.collect(model, query_batches, options=CaptureOptions(projection=projection))
    attr = gradtrace.Attributor("ekfac", train, fisher=fisher)
    with pytest.raises(MissingStage, match=r"attr\.fit"):
        attr.score(queries)
    attr.fit(model, train_batches)
    scores = attr.score(queries)
    assert scores.matrix.shape == (4, 16) and torch.isfinite(scores.matrix).all()
    curvature = attr.method.curvature
    assert "transformer.wte.weight" in curvature.blocks  # the tied weight is one block
    self_scores = attr.self_scores()
    assert (self_scores > 0).all(), "g^T (G + lambda I)^-1 g is positive"


def test_save_load_and_redamp_without_refit(tmp_path):
    model = tiny.llama()
    train_batches, query_batches = _lm_data(1)
    logra = gradtrace.LoGra(rank=4)
    train = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=logra))
    queries = gradtrace.collect(model, query_batches, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("kfac", train, fisher="empirical")
    attr.fit(model, train_batches)
    attr.method.curvature.save(tmp_path / "curv")
    loaded = Curvature.load(tmp_path / "curv")
    assert loaded.kind == "kfac" and loaded.spec.params == train.spec.params
    for name, eig in attr.method.curvature.blocks.items():  # the same numbers in the same memory layout
        for key in ("q_rows", "q_cols", "q", "eigenvalues", "rows_eig", "cols_eig"):
            made, read = getattr(eig, key, None), getattr(loaded.blocks[name], key, None)
            assert (made is None) == (read is None), (name, key)
            if made is not None:
                assert made.is_contiguous() and torch.equal(made, read), (name, key)
    again = gradtrace.Attributor("kfac", train, curvature=tmp_path / "curv").score(queries).matrix
    # identical inputs take the same kernels; the tolerance only covers BLAS choosing by memory alignment
    # (float32 products over a few hundred terms: ~1e-6 relative)
    before = attr.score(queries).matrix
    torch.testing.assert_close(again, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))
    heavy = gradtrace.Attributor("kfac", train, curvature=tmp_path / "curv", damping=10.0).score(queries).matrix
    assert not torch.allclose(heavy, again)
    refit = gradtrace.Attributor("kfac", train, fisher="empirical", damping=10.0)
    refit.fit(model, train_batches)
    refit_scores = refit.score(queries).matrix  # another fit: other summation orders, float32 round-off
    torch.testing.assert_close(refit_scores, heavy, rtol=1e-4, atol=1e-4 * float(heavy.abs().max()))
    assert "damping" in loaded.report()


def test_curvature_from_another_model_or_projection_is_refused(tmp_path):
    model = tiny.gpt2()
    train_batches, query_batches = _lm_data(2)
    train = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    curvature = fit_curvature(model, train_batches, spec=train.spec, fit_options=FitOptions(kind="kfac"))
    other = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=9)))
    with pytest.raises(SpecMismatch, match="projection"):
        gradtrace.Attributor("kfac", other, curvature=curvature).score(other)
    llama = tiny.llama()
    llama_train = gradtrace.collect(llama, train_batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    with pytest.raises(SpecMismatch, match="another model"):
        gradtrace.Attributor("kfac", llama_train, curvature=curvature).score(llama_train)


def test_degenerate_curvature_is_a_clear_error():
    model = nn.Sequential(nn.Linear(3, 2, bias=False))
    x = torch.zeros(6, 3)  # no activation: the input factor is zero
    batches = [(x, torch.zeros(6, 2))]
    from gradtrace.loss.functions import regression_loss

    train = gradtrace.collect(model, batches, regression_loss)
    attr = gradtrace.Attributor("kfac", train, fisher="empirical")
    with pytest.raises(CurvatureError, match="zero curvature"):
        attr.fit(model, batches, regression_loss)
    model = nn.Sequential(nn.Linear(3, 2, bias=False))
    batches = [(torch.randn(2, 3), torch.randn(2, 2))]  # 2 examples cannot span the 6 weight dimensions
    train = gradtrace.collect(model, batches, regression_loss)
    attr = gradtrace.Attributor("ggn", train, fisher="empirical", damping=0.0, damping_mode="absolute")
    attr.fit(model, batches, regression_loss)
    with pytest.raises(CurvatureError, match="singular"):
        attr.score(train)


def test_true_fisher_needs_a_known_loss():
    model = tiny.MLP()
    batches = [(torch.randn(4, 7), torch.randint(0, 4, (4,)))]
    with pytest.raises(ValueError, match="sampled from the model"):
        fit_curvature(model, batches, lambda m, b: m(b[0]).sum(1), fit_options=FitOptions(kind="kfac", fisher="true"))
    with pytest.raises(ValueError, match="fisher must be"):
        fit_curvature(model, batches, fit_options=FitOptions(kind="kfac", fisher="bogus"))


def test_auto_fisher_is_exact_for_small_classifiers_and_sampled_for_lms():
    """kfac/ekfac default to fisher="auto": the exact expectation over labels for a classifier with few classes
    (one pass per class), sampled labels for LMs and wide outputs, the observed labels for a custom loss; the
    curvature records the choice."""
    from gradtrace.fit.curvature.fisher import EXACT_MAX_OUTPUTS

    model = tiny.MLP()  # 4 classes
    x, y = torch.randn(16, 7), torch.randint(0, 4, (16,))
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    train = gradtrace.collect(model, batches)
    for method in ("kfac", "ekfac"):
        auto = gradtrace.Attributor(method, train)
        assert auto.method.options()["fisher"] == "auto"
        auto.fit(model, batches)
        assert auto.method.curvature.fisher == "exact" and auto.method.options()["fisher"] == "exact"
        exact = gradtrace.Attributor(method, train, fisher="exact").fit(model, batches)
        assert torch.equal(auto.score(train).matrix, exact.score(train).matrix)
    wide = nn.Sequential(nn.Linear(7, EXACT_MAX_OUTPUTS + 1))
    labels = torch.randint(0, EXACT_MAX_OUTPUTS + 1, (16,))
    assert fit_curvature(wide, [(x, labels)], fit_options=FitOptions(kind="kfac", fisher="auto")).fisher == "true"
    narrow = nn.Sequential(nn.Linear(7, EXACT_MAX_OUTPUTS))
    assert fit_curvature(narrow, [(x, labels % EXACT_MAX_OUTPUTS)],
                         fit_options=FitOptions(kind="kfac", fisher="auto")).fisher == "exact"
    lm = tiny.gpt2()
    lm_batches, _ = _lm_data(3)
    sampled = fit_curvature(lm, lm_batches, fit_options=FitOptions(kind="kfac", fisher="auto", seed=5))
    assert sampled.fisher == "true"
    want = fit_curvature(lm, lm_batches, fit_options=FitOptions(kind="kfac", fisher="true", seed=5))
    for name, eig in sampled.blocks.items():
        assert torch.equal(eig.eigenvalues, want.blocks[name].eigenvalues), name
    custom = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none") * 2  # gradtrace knows no likelihood
    auto = gradtrace.Attributor("kfac", train).fit(model, batches, custom)
    assert auto.method.curvature.fisher == "empirical"
    empirical = gradtrace.Attributor("kfac", train, fisher="empirical").fit(model, batches, custom)
    assert torch.equal(auto.score(train).matrix, empirical.score(train).matrix)


def test_logra_fisher_follows_its_mode():
    model = tiny.MLP()
    x, y = torch.randn(16, 7), torch.randint(0, 4, (16,))
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    fitted = gradtrace.Attributor("logra", train, mode="ekfac").fit(model, batches)  # EK-FAC, projected space
    assert fitted.method.curvature.fisher == "exact" and fitted.method.curvature.kind == "ekfac"
    dense = gradtrace.Attributor("logra", train).fit()  # from the store alone: the empirical Fisher
    assert dense.method.curvature.fisher == "empirical"
    with pytest.raises(ValueError, match=r"mode 'dense'.*empirical"):
        gradtrace.Attributor("logra", train, fisher="true").fit()


def test_logra_auto_mode_is_dense_when_the_store_can_estimate_every_block():
    model = tiny.MLP()
    x, y = torch.randn(24, 7), torch.randint(0, 4, (24,))
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    # rank 4: the largest projected block has 16 dimensions, 24 examples can estimate it -> the dense Fisher
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    assert max(dim for _, dim in train.spec.params) == 16
    auto = gradtrace.Attributor("logra", train).fit(model, batches)
    assert auto.method.mode_used == "dense" and auto.method.curvature.kind == "fisher"
    dense = gradtrace.Attributor("logra", train, mode="dense").fit()
    assert torch.equal(auto.score(train).matrix, dense.score(train).matrix)
    # a block of 36 dimensions and 24 examples: the dense estimate would be rank-deficient -> EK-FAC (model pass)
    wide = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=6)))
    auto = gradtrace.Attributor("logra", wide).fit(model, batches)
    assert auto.method.mode_used == "ekfac" and auto.method.curvature.kind == "ekfac"
    assert gradtrace.Attributor("logra", wide).fit().method.mode_used == "dense"  # no model: the store alone
    # blocks wider than max_dense would be kept diagonal by the dense mode -> EK-FAC
    capped = gradtrace.Attributor("logra", train, max_dense=8).fit(model, batches)
    assert capped.method.mode_used == "ekfac"
    # a model-pass Fisher asked for -> EK-FAC
    assert gradtrace.Attributor("logra", train, fisher="true").fit(model, batches).method.mode_used == "ekfac"


def test_pca_logra_keeps_top_kronecker_directions():
    """PCA-initialised LoGra projects onto the top eigenvectors of the K-FAC factors: with the full rank it is
    an orthogonal change of basis (inner products preserved exactly), and its spec is refused against random."""
    model = tiny.MLP()
    x, y = torch.randn(24, 7), torch.randint(0, 4, (24,))
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]
    full = gradtrace.LoGra.pca(model, batches, rank=12)  # >= every layer width: nothing is dropped
    exact = gradtrace.collect(model, batches)
    projected = gradtrace.collect(model, batches, options=CaptureOptions(projection=full))
    assert projected.spec.projection["init"] == "pca" and "basis" in projected.spec.projection
    gram_exact = exact.vectors @ exact.vectors.t()
    gram_projected = projected.vectors @ projected.vectors.t()
    assert torch.allclose(gram_projected, gram_exact, rtol=1e-4, atol=1e-4 * float(gram_exact.abs().max()))
    small = gradtrace.LoGra.pca(model, batches, rank=2)
    top = gradtrace.collect(model, batches, options=CaptureOptions(projection=small))
    random = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(SpecMismatch, match="projection"):
        gradtrace.Attributor("grad_dot", top).score(random)
    del random
    # rank 2 in the top-eigenvector basis keeps more gradient energy than a random orthonormal rank-2 basis
    params = dict(model.named_parameters())
    offsets = exact.spec.offsets()
    gen = torch.Generator().manual_seed(0)
    random_energy = 0.0
    for name, (start, stop) in offsets.items():
        shape = params[name].shape
        grads = exact.vectors[:, start:stop].reshape(len(exact), shape[0], -1)
        if grads.shape[2] == 1:  # vector parameter
            basis = torch.linalg.qr(torch.randn(shape[0], 2, generator=gen))[0]
            random_energy += float((grads[:, :, 0] @ basis).pow(2).sum())
            continue
        rows = torch.linalg.qr(torch.randn(grads.shape[1], 2, generator=gen))[0]
        cols = torch.linalg.qr(torch.randn(grads.shape[2], 2, generator=gen))[0]
        random_energy += float((rows.t() @ grads @ cols).pow(2).sum())
    assert float(top.vectors.pow(2).sum()) > random_energy
