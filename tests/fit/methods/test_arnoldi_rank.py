"""arnoldi's rank check on a model with a known spectrum: a bias-free linear regressor on inputs built so that its
Gauss-Newton matrix ``X^T X / N`` has the eigenvalues ``2^-k`` (k = 0..23), in a random basis. With the default
damping (0.1 x the mean eigenvalue) the eigenvalues above lambda are known, so is where the warning must start."""

import warnings

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.loss.functions import regression_loss

DIM, N = 24, 48


def _known_spectrum():
    torch.manual_seed(0)
    eigenvalues = 2.0 ** -torch.arange(DIM, dtype=torch.float64)
    rows, _ = torch.linalg.qr(torch.randn(N, N, dtype=torch.float64))
    basis, _ = torch.linalg.qr(torch.randn(DIM, DIM, dtype=torch.float64))
    x = (N ** 0.5 * rows[:, :DIM] * eigenvalues.sqrt()) @ basis.t()  # X^T X / N = basis diag(eigenvalues) basis^T
    model = nn.Linear(DIM, 1, bias=False)
    batches = [(x[:20].float(), torch.randn(20, 1)), (x[20:].float(), torch.randn(N - 20, 1))]
    return model, batches, eigenvalues


def _fit(model, batches, rank):
    train = gradtrace.collect(model, batches, regression_loss)
    return gradtrace.Attributor("arnoldi", train, rank=rank, iterations=DIM, precision="float64").fit(
        model, batches, regression_loss)


def test_the_spectrum_is_the_known_one():
    model, batches, eigenvalues = _known_spectrum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        attr = _fit(model, batches, DIM)
    x = torch.cat([inputs for inputs, _ in batches]).double()  # the float32 inputs the model sees
    exact = torch.linalg.eigvalsh(x.t() @ x / N).flip(0)
    # float64 products and a full Krylov basis: round-off of eps64 x the largest eigenvalue, far below the smallest
    torch.testing.assert_close(attr.method.eigenvalues, exact, rtol=1e-9, atol=1e-13)
    # the float32 rounding of the inputs moves the designed spectrum by a few eps32 relative
    torch.testing.assert_close(exact, eigenvalues, rtol=1e-5, atol=0)


@pytest.mark.parametrize("rank", [4, 7])
def test_a_rank_short_of_the_eigenvalues_above_lambda_warns_with_the_ratio(rank):
    model, batches, eigenvalues = _known_spectrum()
    lam = 0.1 * float(eigenvalues.mean())  # 0.00833: 2^-6 = 0.0156 is above it, 2^-7 = 0.0078 below
    ratio = float(eigenvalues[rank - 1]) / lam  # 15.0 at rank 4, 1.88 at rank 7
    with pytest.warns(RuntimeWarning, match=rf"rank {rank} stops at eigenvalue .* = {ratio:.3g} x lambda.*raise rank="):
        attr = _fit(model, batches, rank)
    options = attr.method.options()
    assert options["smallest_kept_over_lambda"] == pytest.approx(ratio, rel=1e-5)  # float32 diag(G): a few eps32
    share = float(eigenvalues[rank:].sum() / eigenvalues.sum())
    assert options["discarded_trace_share"] == pytest.approx(share, rel=1e-4, abs=1e-6)


def test_a_rank_covering_the_eigenvalues_above_lambda_does_not_warn():
    model, batches, eigenvalues = _known_spectrum()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        attr = _fit(model, batches, 8)  # 2^-7 = 0.94 lambda: every eigenvalue above lambda kept
    assert attr.method.options()["smallest_kept_over_lambda"] < 1
