"""fisher="true" for a custom loss through a named likelihood (gradtrace.loss.likelihoods): the same sampled labels as
the built-in path on the same model, data and seed, and, in expectation, the analytic Fisher within Monte-Carlo
error."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.curvature import fit_curvature
from gradtrace.loss.functions import classification_loss, regression_loss
from gradtrace.loss.likelihoods import categorical, gaussian
from gradtrace.options import FitOptions, Loss
from tests import tiny


def _same(a, b):
    assert a.blocks.keys() == b.blocks.keys()
    for name, eig in a.blocks.items():
        torch.testing.assert_close(eig.eigenvalues, b.blocks[name].eigenvalues, rtol=1e-6, atol=0, msg=name)


def _lm_batches():
    torch.manual_seed(0)
    ids = torch.randint(1, tiny.VOCAB, (8, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    mask[5, 4:] = 0
    return [{"input_ids": ids[i:i + 4], "attention_mask": mask[i:i + 4]} for i in (0, 4)]


def my_lm_loss(model, batch):
    """A custom LM forward + loss (gradtrace does not recognise it): per-document summed next-token loss."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape).sum(1)


def my_lm_logits(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def my_lm_mask(batch):
    """[B, T]: the positions whose next token is scored (the last one and padding are not)."""
    kept = batch["attention_mask"][:, 1:] == 1
    return torch.cat([kept, torch.zeros_like(kept[:, :1])], dim=1)


def test_custom_lm_loss_with_a_categorical_likelihood_samples_the_built_in_labels():
    model, batches = tiny.gpt2(), _lm_batches()
    built_in = fit_curvature(model, batches, fit_options=FitOptions(kind="kfac", fisher="true", seed=5, samples=2))
    likelihood = categorical(my_lm_logits, mask=my_lm_mask)
    custom = fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=likelihood),
                           fit_options=FitOptions(kind="kfac", fisher="true", seed=5, samples=2))
    assert custom.fisher == "true"
    _same(custom, built_in)
    auto = fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=likelihood),
                         fit_options=FitOptions(kind="kfac", fisher="auto", seed=5, samples=2))
    assert auto.fisher == "true"
    _same(auto, built_in)


def _dense(curvature):
    (eig,) = curvature.blocks.values()
    vectors = eig.q if eig.q is not None else torch.eye(eig.eigenvalues.numel())
    return (vectors * eig.eigenvalues) @ vectors.t()


def test_sampled_fisher_of_a_custom_classifier_matches_the_analytic_fisher_in_expectation():
    torch.manual_seed(1)
    model = nn.Linear(4, 3, bias=False)
    x, y = torch.randn(6, 4) * 2, torch.randint(0, 3, (6,))
    batches = [(x, y)]
    custom_loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")
    likelihood = categorical(lambda m, b: m(b[0]))
    # analytic: sum_n (diag(p_n) - p_n p_n^T) (x) x_n x_n^T, as gradtrace's exact Fisher enumerates it
    exact = _dense(fit_curvature(model, batches, classification_loss,
                                 fit_options=FitOptions(kind="fisher", fisher="exact", max_dense=64)))
    with torch.no_grad():
        probs = torch.softmax(model(x), -1)
    analytic = sum(torch.kron(torch.diag(p) - torch.outer(p, p), torch.outer(xn, xn)) for p, xn in zip(probs, x))
    scale = float(exact.trace() / analytic.trace())
    loss = Loss(fn=custom_loss, likelihood=likelihood)
    sampled = [FitOptions(kind="fisher", fisher="true", seed=s, samples=40, max_dense=64) for s in range(6)]
    fits = torch.stack([_dense(fit_curvature(model, batches, loss, fit_options=fitting)) for fitting in sampled])
    mean, se = fits.mean(0), fits.std(0) / fits.shape[0] ** 0.5
    # 240 draws per example: the mean is the Fisher within a few standard errors (Frobenius norm, 5 SE)
    assert float((mean - exact).norm()) <= 5 * float(se.norm()), (float((mean - exact).norm()), float(se.norm()))
    assert float(se.norm()) < 0.2 * float(exact.norm())  # and the test has power: the error bar is small
    # the exact Fisher is the analytic one up to gradtrace's normalisation (a positive constant)
    torch.testing.assert_close(exact, analytic * scale, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))


def test_gaussian_likelihood_equals_the_built_in_regression_fisher_and_scales_with_the_variance():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    built_in = fit_curvature(model, batches, regression_loss,
                             fit_options=FitOptions(kind="kfac", fisher="true", seed=3))
    custom_loss = lambda m, b: 0.5 * (m(b[0]) - b[1]).pow(2).sum(1)
    unit = fit_curvature(model, batches, Loss(fn=custom_loss, likelihood=gaussian(lambda m, b: m(b[0]))),
                         fit_options=FitOptions(kind="kfac", fisher="true", seed=3))
    _same(unit, built_in)
    wide = fit_curvature(model, batches, Loss(fn=custom_loss, likelihood=gaussian(lambda m, b: m(b[0]), variance=4.0)),
                         fit_options=FitOptions(kind="kfac", fisher="true", seed=3))
    for name, eig in wide.blocks.items():  # the same noise draws, gradients -noise/2 instead of -noise: K-FAC's
        # output-gradient factor is 1/4, its activation factor unchanged; float32 eigenvalues are exact to a few
        # eps32 of the largest one
        want = unit.blocks[name].eigenvalues / 4
        torch.testing.assert_close(eig.eigenvalues, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_attributor_fit_takes_the_likelihood_and_bad_input_is_refused():
    model, batches = tiny.gpt2(), _lm_batches()
    train = gradtrace.collect(model, batches)
    likelihood = categorical(my_lm_logits, mask=my_lm_mask)
    attr = gradtrace.Attributor("kfac", train, fisher="true", seed=5).fit(model, batches, my_lm_loss,
                                                                         likelihood=likelihood)
    want = gradtrace.Attributor("kfac", train, fisher="true", seed=5).fit(model, batches)
    _same(attr.method.curvature, want.method.curvature)
    with pytest.raises(ValueError, match=r"likelihood=gradtrace\.loss\.likelihoods\.categorical"):
        fit_curvature(model, batches, my_lm_loss, fit_options=FitOptions(kind="kfac", fisher="true"))
    with pytest.raises(ValueError, match="unused: pass fisher='true'"):
        fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=likelihood),
                      fit_options=FitOptions(kind="kfac", fisher="empirical"))
    with pytest.raises(ValueError, match="with likelihood= use fisher='true'"):
        fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=likelihood),
                      fit_options=FitOptions(kind="kfac", fisher="exact"))
    with pytest.raises(ValueError, match="mask must be shaped like the logits"):
        masked = categorical(my_lm_logits, mask=lambda b: b["attention_mask"][:, 1:])
        fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=masked),
                      fit_options=FitOptions(kind="kfac", fisher="true"))
    with pytest.raises(TypeError, match=r"must be a gradtrace\.loss\.likelihoods\.Likelihood"):
        fit_curvature(model, batches, Loss(fn=my_lm_loss, likelihood=my_lm_logits),
                      fit_options=FitOptions(kind="kfac", fisher="true"))
    with pytest.raises(ValueError, match="variance must be > 0"):
        gaussian(my_lm_logits, variance=0.0)
