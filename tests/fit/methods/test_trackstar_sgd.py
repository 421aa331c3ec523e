"""TrackStar for an SGD-trained model: the default (Adam's second moment) refuses SGD's state naming
``second_moment="none"``; that option is ``n = g`` (SGD's update applies the raw gradient), checked against per-example
gradients by one backward pass each (float64), unpreconditioned and with the autocorrelation."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.fit.methods import load_fit, save_fit
from gradtrace.fit.methods.less import NoAdamState
from gradtrace.loss.functions import classification_loss
from tests.fit.methods.test_trackstar import _cos, _grads
from tests.fit.methods.test_trak import Net


def _sgd_setup(momentum):
    torch.manual_seed(7)
    model = Net()
    x, y = torch.randn(30, 5) * 2, torch.randint(0, 3, (30,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    train = gradtrace.collect(model, [{"inputs": x[i:i + 8], "labels": y[i:i + 8]} for i in range(0, 30, 8)],
                              classification_loss)
    qx, qy = torch.randn(4, 5), torch.randint(0, 3, (4,))
    query = gradtrace.collect(model, [{"inputs": qx, "labels": qy}], classification_loss)
    return model, optimizer, train, query, x, y, qx, qy


@pytest.mark.parametrize("momentum", [0.9, 0.0])  # a momentum_buffer, and SGD's empty state
def test_the_default_refuses_an_sgd_state_naming_the_option(momentum, tmp_path):
    model, optimizer, train, *_ = _sgd_setup(momentum)
    for given in (optimizer, optimizer.state_dict()):
        with pytest.raises(NoAdamState, match=r"SGD.*normaliser an SGD run implies is 1.*second_moment='none'"):
            gradtrace.Attributor("trackstar", train).fit(model, optimizer=given)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")  # a Trainer checkpoint directory
    with pytest.raises(NoAdamState, match="second_moment='none'"):
        gradtrace.Attributor("trackstar", train).fit(model, optimizer=tmp_path)


def test_second_moment_none_is_the_cosine_of_the_raw_gradients(tmp_path):
    model, optimizer, train, query, x, y, qx, qy = _sgd_setup(0.9)
    want = _cos(_grads(model, qx, qy), _grads(model, x, y))
    # float32 gradients and norms of O(1) cosines: a few hundred eps32 (as test_trackstar.py)
    unfitted = gradtrace.Attributor("trackstar", train, second_moment="none")  # nothing to fit
    torch.testing.assert_close(unfitted.score(query).matrix.double(), want, rtol=0, atol=2e-5)
    attr = gradtrace.Attributor("trackstar", train, second_moment="none").fit(model)
    got = attr.score(query).matrix
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    assert attr.method.options()["second_moment"] == "none"
    save_fit(attr, tmp_path / "fit")
    loaded = load_fit(tmp_path / "fit")
    assert loaded.second_moment == "none"
    torch.testing.assert_close(gradtrace.Attributor(loaded, train).score(query).matrix, got, rtol=0, atol=1e-6)


def test_second_moment_none_with_the_autocorrelation_equals_the_hand_computation():
    model, _, train, query, x, y, qx, qy = _sgd_setup(0.9)
    attr = gradtrace.Attributor("trackstar", train, second_moment="none", precondition="autocorrelation",
                                damping=0.1).fit(model)
    train_n, query_n = _grads(model, x, y), _grads(model, qx, qy)  # n = g
    kernel = train_n.t() @ train_n
    lam = 0.1 * torch.linalg.eigvalsh(kernel).clamp(min=0).mean()
    inverse = torch.linalg.inv(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64))
    norm_q = ((query_n @ inverse) * query_n).sum(1).sqrt()
    norm_i = ((train_n @ inverse) * train_n).sum(1).sqrt()
    want = (query_n @ inverse @ train_n.t()) / norm_q[:, None] / norm_i[None, :]
    # as test_trackstar.py's autocorrelation test: float32 rows through a float64 solve
    torch.testing.assert_close(attr.score(query).matrix.double(), want, rtol=0, atol=5e-5)


def test_second_moment_refusals():
    model, optimizer, train, *_ = _sgd_setup(0.9)
    with pytest.raises(ValueError, match="second_moment must be one of adam, none"):
        gradtrace.Attributor("trackstar", train, second_moment="sgd")
    with pytest.raises(ValueError, match="eps is added to Adam's"):
        gradtrace.Attributor("trackstar", train, second_moment="none", eps=1e-8)
    with pytest.raises(ValueError, match="reads no optimizer state"):  # an Adam state is never silently ignored
        gradtrace.Attributor("trackstar", train, second_moment="none").fit(model, optimizer=optimizer)
