"""SAMA reweighting: the finite-difference meta-gradient equals the exact mixed term, Adam's update Jacobian is
exact, parameters are restored exactly after the probes, and weights separate corrupted from clean data."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradtrace.options.train import ReweightingOptions
from gradtrace.train import SAMAReweighting, adam_update_jacobian
from tests import tiny


def per_example(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _flat_grad(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def test_finite_difference_scores_equal_exact_mixed_term():
    """score_i = [l_i(theta + eps v) - l_i(theta - eps v)] / (2 eps) ~ g_i . v with v = lr * grad L_meta (SGD)."""
    torch.manual_seed(0)
    model = tiny.MLP()
    x, y = torch.randn(6, 7), torch.randint(0, 4, (6,))
    meta = (torch.randn(5, 7), torch.randint(0, 4, (5,)))
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sama = SAMAReweighting(model, opt, [meta], loss_fn=per_example, options=ReweightingOptions(alpha=1e-2))
    sama.loss((x, y), ids=[f"e{i}" for i in range(6)]).backward()
    v = lr * _flat_grad(model, per_example(model, meta).mean())
    exact = torch.tensor([float(_flat_grad(model, per_example(model, (x[i:i + 1], y[i:i + 1])).sum()) @ v)
                          for i in range(6)])
    opt.step()  # the meta step runs first (pre-hook), then SGD moves the weights
    got = torch.tensor([sama.scores[f"e{i}"] for i in range(6)])
    assert torch.allclose(got, exact, rtol=1e-2, atol=1e-3 * float(exact.abs().max()))
    assert (got.sign() == exact.sign()).all()


def test_parameters_are_restored_exactly_after_the_probes():
    torch.manual_seed(1)
    model = tiny.MLP()
    x, y = torch.randn(6, 7), torch.randint(0, 4, (6,))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sama = SAMAReweighting(model, opt, [(torch.randn(4, 7), torch.randint(0, 4, (4,)))], loss_fn=per_example)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append([p.detach().clone() for p in model.parameters()]))
    sama.loss((x, y), ids=list("abcdef")).backward()
    opt.step()
    assert len(sama.history) == 1 and len(sama.scores) == 6
    for p, q in zip(seen[0], before):  # after the probes, before Adam's own update
        assert torch.equal(p, q)


def test_adam_update_jacobian_matches_autograd():
    torch.manual_seed(2)
    param = nn.Parameter(torch.randn(5))
    opt = torch.optim.Adam([param], lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    for _ in range(3):  # give it moments
        param.grad = torch.randn(5)
        opt.step()
    grad = torch.randn(5)
    state = opt.state[param]
    t = int(state["step"]) + 1

    def update(g):
        m = 0.8 * state["exp_avg"] + 0.2 * g
        v = 0.95 * state["exp_avg_sq"] + 0.05 * g * g
        return 0.01 * (m / (1 - 0.8**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-6)

    jac = torch.autograd.functional.jacobian(update, grad)
    assert torch.allclose(adam_update_jacobian(opt, param, grad), torch.diagonal(jac), rtol=1e-5, atol=1e-9)


def test_weights_separate_corrupted_from_clean_examples():
    torch.manual_seed(3)
    teacher = nn.Linear(7, 4)
    x = torch.randn(96, 7)
    y = teacher(x).argmax(1)
    corrupted = torch.zeros(96, dtype=torch.bool)
    corrupted[:29] = True
    noisy = y.clone()
    noisy[corrupted] = (y[corrupted] + 1 + torch.randint(0, 3, (29,))) % 4
    meta_x = torch.randn(64, 7)
    meta = [(meta_x, teacher(meta_x).argmax(1))]
    model = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sama = SAMAReweighting(model, opt, meta, loss_fn=per_example, options=ReweightingOptions(meta_lr=0.3))
    ids = [f"e{i}" for i in range(96)]
    for _epoch in range(15):
        order = torch.randperm(96)
        for start in range(0, 96, 16):
            rows = order[start:start + 16]
            sama.loss((x[rows], noisy[rows]), ids=[ids[i] for i in rows]).backward()
            opt.step()
            opt.zero_grad()
    weights = torch.tensor([sama.weights[i] for i in ids])
    assert weights[corrupted].mean() < weights[~corrupted].mean()
    # AUC of "low weight = corrupted"
    auc = (weights[corrupted].unsqueeze(1) < weights[~corrupted].unsqueeze(0)).float().mean()
    assert auc >= 0.8, float(auc)


def _train(sama, opt, x, y, ids, steps, batch=8):
    for step in range(steps):
        rows = torch.arange(step * batch, (step + 1) * batch) % len(ids)
        sama.loss((x[rows], y[rows]), ids=[ids[i] for i in rows]).backward()
        opt.step()
        opt.zero_grad()


def _setup(seed, optimizer=torch.optim.Adam, groups=None, **settings):
    torch.manual_seed(seed)
    model = tiny.MLP()
    opt = optimizer(model.parameters(), lr=0.01)
    meta = [(torch.randn(6, 7), torch.randint(0, 4, (6,)))]
    return model, opt, SAMAReweighting(model, opt, meta, loss_fn=per_example, groups=groups,
                                       options=ReweightingOptions(**settings))


def test_saved_state_resumes_training_exactly(tmp_path):
    """Saving after 3 steps and resuming in a fresh callback gives the weights of an uninterrupted run."""
    x, y = torch.randn(24, 7), torch.randint(0, 4, (24,))
    ids = [f"e{i}" for i in range(24)]
    model, opt, sama = _setup(5, meta_lr=0.2)
    _train(sama, opt, x, y, ids, 6)
    want = sama.weights

    model, opt, sama = _setup(5, meta_lr=0.2)
    _train(sama, opt, x, y, ids, 3)
    path = sama.save(tmp_path / "w.json")
    model_state, opt_state = model.state_dict(), opt.state_dict()
    sama.close()
    model, opt, resumed = _setup(5, meta_lr=0.2)
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    payload = SAMAReweighting.load(path)
    assert payload["weights"] == pytest.approx(sama.weights)
    resumed.load_state_dict(payload["state"])
    for step in range(3, 6):  # the same batches as the uninterrupted run's steps 3..5
        rows = torch.arange(step * 8, (step + 1) * 8) % 24
        resumed.loss((x[rows], y[rows]), ids=[ids[i] for i in rows]).backward()
        opt.step()
        opt.zero_grad()
    assert resumed.weights == pytest.approx(want, rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="not a SAMA weights file"):
        (tmp_path / "other.json").write_text('{"format": "x"}')
        SAMAReweighting.load(tmp_path / "other.json")


def test_keep_prunes_by_weight():
    _, _, sama = _setup(6)
    sama.logits = {"a": torch.tensor(2.0), "b": torch.tensor(-1.0), "c": torch.tensor(0.5), "d": torch.tensor(-3.0)}
    assert sama.keep(fraction=0.5) == ["a", "c"]
    assert sorted(sama.keep(threshold=0.5)) == ["a", "c"]
    with pytest.raises(ValueError, match="exactly one"):
        sama.keep()


def test_per_source_weights_sum_their_examples_scores():
    """groups={id: source}: one logit per source, whose gradient sums its examples' meta-gradients."""
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    ids = [f"e{i}" for i in range(8)]
    groups = {i: ("web" if n % 2 else "books") for n, i in enumerate(ids)}
    _, opt, sama = _setup(7, optimizer=torch.optim.SGD, groups=groups, meta_lr=0.1)
    sama.loss((x, y), ids=ids).backward()
    opt.step()
    assert set(sama.weights) == {"web", "books"}
    web = sum(sama.scores[i] for i in ids if groups[i] == "web")
    books = sum(sama.scores[i] for i in ids if groups[i] == "books")
    # the first Adam step moves each logit by meta_lr in the direction of its summed score
    assert (sama.weights["web"] > 0.5) == (web > 0) and (sama.weights["books"] > 0.5) == (books > 0)
    with pytest.raises(KeyError, match="no group"):
        sama.loss((x[:1], y[:1]), ids=["stranger"])
    with pytest.raises(ValueError, match="per source"):
        _, _, other = _setup(7)
        other.load_state_dict(sama.state_dict())


def test_unsupported_optimizer_and_exhausted_meta_data_are_clear():
    x, y = torch.randn(4, 7), torch.randint(0, 4, (4,))
    torch.manual_seed(8)
    model = tiny.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sama = SAMAReweighting(model, opt, [(x, y)], loss_fn=per_example)
    sama.loss((x, y), ids=list("abcd")).backward()
    with pytest.raises(TypeError, match="SGD \\(no momentum\\) and Adam"):
        opt.step()
    sama.close()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    one_shot = iter([(x, y)])
    sama = SAMAReweighting(model, opt, one_shot, loss_fn=per_example)
    for _ in range(2):
        opt.zero_grad()
        sama.loss((x, y), ids=list("abcd")).backward()
        if _ == 0:
            opt.step()
    with pytest.raises(ValueError, match="ran out"):
        opt.step()


def test_every_setting_of_the_options_reaches_the_loop():
    """ReweightingOptions' settings, checked against quantities computed here: ``id_key`` names the batch's ids,
    ``normalize`` divides the weighted loss by the weights' sum, ``start_step`` / ``interval`` choose the meta
    steps, and the first Adam step moves each logit from ``init_logit`` by ``meta_lr`` towards its score's sign."""
    torch.manual_seed(9)
    model = tiny.MLP()
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    meta = (torch.randn(5, 7), torch.randint(0, 4, (5,)))

    def dict_loss(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    options = ReweightingOptions(meta_lr=0.3, alpha=1e-3, interval=2, start_step=1, init_logit=0.5, id_key="idx",
                                 normalize=True)
    sama = SAMAReweighting(model, opt, [{"x": meta[0], "y": meta[1]}], loss_fn=dict_loss, options=options)
    x, y = torch.randn(6, 7), torch.randint(0, 4, (6,))
    batch = {"x": x, "y": y, "idx": [f"e{i}" for i in range(6)]}
    scores_at_step_1 = None
    for step in range(5):
        losses = per_example(model, (x, y)).detach()
        w = torch.sigmoid(torch.tensor([float(sama.logits.get(i, torch.tensor(0.5))) for i in batch["idx"]]))
        loss = sama.loss(batch)
        assert torch.allclose(loss, (w * losses).sum() / w.sum(), rtol=1e-6)  # normalize: sum w l / sum w
        if step <= 1:
            assert torch.allclose(loss, losses.mean(), rtol=1e-6)  # every weight still sigmoid(init_logit)
        loss.backward()
        if step == 1:
            v = lr * _flat_grad(model, per_example(model, meta).mean())
            scores_at_step_1 = [float(_flat_grad(model, per_example(model, (x[i:i + 1], y[i:i + 1])).sum()) @ v)
                                for i in range(6)]
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert sama.weights == {} and sama.history == []  # before start_step: weights stay at init_logit
        if step == 1:
            want = {f"e{i}": 0.5 + 0.3 * (1.0 if s > 0 else -1.0) for i, s in enumerate(scores_at_step_1)}
            got = {k: float(v) for k, v in sama.logits.items()}
            assert got == pytest.approx(want, abs=1e-3)
    assert [h["step"] for h in sama.history] == [1, 3]  # start_step=1, then every interval=2 steps


@pytest.mark.parametrize("settings,name", [
    ({"alpha": 0.0}, "alpha"), ({"meta_lr": float("nan")}, "meta_lr"), ({"interval": 0}, "interval"),
    ({"start_step": -1}, "start_step"), ({"init_logit": float("inf")}, "init_logit"), ({"interval": 1.5}, "interval"),
])
def test_a_bad_setting_is_refused_when_the_options_are_made(settings, name):
    with pytest.raises(ValueError, match=rf"^{name} must be [^\n]+, got "):
        ReweightingOptions(**settings)
    model = tiny.MLP()
    with pytest.raises(TypeError, match="ReweightingOptions"):
        SAMAReweighting(model, torch.optim.SGD(model.parameters(), lr=0.1), [], loss_fn=per_example,
                        options=settings)
