"""LESS: Adam-preconditioned features equal a brute-force loop, scores equal the formula, mixing is refused."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.fit.methods.less import less_aggregate, less_features, less_query_features
from gradtrace.options import CaptureOptions, RunOptions, StoreOptions
from gradtrace.projection.sketch import DenseProjection, SparseProjection
from gradtrace.store import SpecMismatch
from tests import tiny


def _data(n, seed, d=7, classes=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _batches(x, y, size=3):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _train(model, optimizer, steps, seed=10):
    x, y = _data(6 * steps, seed)
    for xb, yb in _batches(x, y, 6):
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()


def _example_grads(model, x, y, names):
    """Brute force: one backward pass per example, ``[E, D]`` over ``names`` (float64)."""
    loss = lambda m, ex: F.cross_entropy(m(ex[0]), ex[1], reduction="sum")
    ref = tiny.reference_grads(model, [(x[i:i + 1], y[i:i + 1]) for i in range(len(x))], loss)
    return {n: ref[n].reshape(len(x), -1).double() for n in names}


def _adam_by_hand(grads, optimizer, params, names):
    """Adam's next update for each example's gradient alone, from the optimizer's state (float64)."""
    parts = []
    for name in names:
        param = params[name]
        state = optimizer.state[param]
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        b1, b2 = group["betas"]
        eps, t = group["eps"], float(state["step"]) + 1
        g = grads[name]
        m = b1 * state["exp_avg"].reshape(1, -1).double() + (1 - b1) * g
        v = b2 * state["exp_avg_sq"].reshape(1, -1).double() + (1 - b2) * g * g
        if group["amsgrad"]:
            v = torch.maximum(v, state["max_exp_avg_sq"].reshape(1, -1).double())
        parts.append((m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps))
    return torch.cat(parts, dim=1)


def _sketched(rows, sketch):
    return rows @ sketch.matrix(rows.shape[1], "less").double().t()


def _close(got, want, rtol=1e-4):
    err = (got.double() - want).abs().max()
    assert err <= rtol * want.abs().max(), f"max abs err {err:.3e} (ref max {want.abs().max():.3e})"


def test_less_features_equal_brute_force_adam():
    model = tiny.MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6)
    _train(model, optimizer, steps=3)
    x, y = _data(7, seed=1)
    sketch = DenseProjection(24, seed=3)
    feats = less_features(model, optimizer, _batches(x, y), options=CaptureOptions(projection=sketch),
                          run=RunOptions(ids=[f"t{i}" for i in range(7)]))
    names = [n for n, _ in feats.spec.projection["inputs"]]
    assert names == [n for n, _ in model.named_parameters()]
    want = _sketched(_adam_by_hand(_example_grads(model, x, y, names), optimizer, dict(model.named_parameters()),
                                   names), sketch)
    _close(feats.vectors, want)
    assert feats.ids == [f"t{i}" for i in range(7)]
    spec = feats.spec
    assert spec.projection["kind"] == "less" and spec.projection["sketch"] == sketch.to_dict()
    assert spec.convention["features"] == "adam"
    assert spec.convention["optimizer"]["betas"] == [0.8, 0.99] and spec.convention["optimizer"]["step"] == 3.0
    # the state dict gives the same features (parameters matched by position, then shapes checked)
    again = less_features(model, optimizer.state_dict(), _batches(x, y, 4), options=CaptureOptions(projection=sketch))
    assert torch.allclose(again.vectors, feats.vectors, rtol=1e-5, atol=1e-6)


def test_less_features_state_dict_of_trainable_subset_amsgrad_sparse_sketch(tmp_path):
    model = tiny.MLP()
    for p in model.net[0].parameters():  # frozen: the optimizer holds only the trainable ones
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02, amsgrad=True,
                                  weight_decay=0.1)
    _train(model, optimizer, steps=4)
    x, y = _data(5, seed=2)
    sketch = SparseProjection(40, seed=1, nnz=2)
    store = less_features(model, optimizer.state_dict(), _batches(x, y, 2), store=tmp_path / "less",
                          options=CaptureOptions(layers=["net.3", "net.6"], projection=sketch))
    names = [n for n, _ in store.spec.projection["inputs"]]
    assert names == ["net.3.weight", "net.3.bias", "net.6.weight", "net.6.bias"]
    want = _sketched(_adam_by_hand(_example_grads(model, x, y, names), optimizer, dict(model.named_parameters()),
                                   names), sketch)
    _close(store.read(0, len(store)), want)
    assert store.spec.convention["optimizer"]["amsgrad"] is True


def test_less_scores_equal_the_formula():
    model = tiny.MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data(8, seed=4)
    qx, qy = _data(3, seed=5)
    sketch = DenseProjection(32, seed=0, kind="rademacher")
    train, queries, cosines = [], [], []
    params = dict(model.named_parameters())
    lrs = [0.01, 0.004]
    for lr in lrs:
        _train(model, optimizer, steps=2, seed=int(lr * 1000))
        train.append(less_features(model, optimizer, _batches(x, y), options=CaptureOptions(projection=sketch)))
        queries.append(less_query_features(model, _batches(qx, qy, 2), options=CaptureOptions(projection=sketch)))
        names = [n for n, _ in train[-1].spec.projection["inputs"]]
        gamma = _sketched(_adam_by_hand(_example_grads(model, x, y, names), optimizer, params, names), sketch)
        q = _example_grads(model, qx, qy, names)
        query = _sketched(torch.cat([q[n] for n in names], dim=1), sketch)
        _close(queries[-1].vectors, query)
        cos = F.normalize(query, dim=1) @ F.normalize(gamma, dim=1).t()
        cosines.append(cos)
    want = lrs[0] * cosines[0] + lrs[1] * cosines[1]
    scores = gradtrace.Attributor("less", train, weights=lrs, block_rows=3).score(queries)
    _close(scores.matrix, want)
    # one checkpoint needs no weight
    single = gradtrace.Attributor("less", train[1]).score([queries[1]])
    _close(single.matrix, cosines[1])
    # LESS's selection score: mean over each task's queries, max over tasks
    agg = less_aggregate(scores, groups=["a", "b", "a"])
    m = scores.matrix
    assert torch.allclose(agg, torch.maximum((m[0] + m[2]) / 2, m[1]))


def test_less_refuses_other_gradients_and_missing_adam_state(tmp_path):
    model = tiny.MLP()
    x, y = _data(4, seed=6)
    sketch = DenseProjection(8)
    fresh = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"has no Adam state.*not stepped"):
        less_features(model, fresh, _batches(x, y), options=CaptureOptions(projection=sketch))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, sgd, steps=1)
    with pytest.raises(ValueError, match="not an Adam state"):
        less_features(model, sgd, _batches(x, y), options=CaptureOptions(projection=sketch))
    partial = torch.optim.Adam(model.net[6].parameters())
    _train(model, partial, steps=1)
    with pytest.raises(ValueError, match="not optimized by this optimizer"):
        less_features(model, partial, _batches(x, y), options=CaptureOptions(projection=sketch))
    with pytest.raises(TypeError, match=r"DenseProjection\(k\) or SparseProjection\(k\).*got projection=None"):
        less_features(model, partial, _batches(x, y), options=CaptureOptions(layers=["net.6"]))

    feats = less_features(model, partial, _batches(x, y), store=tmp_path / "train",
                          options=CaptureOptions(layers=["net.6"], projection=sketch),
                          run=RunOptions(ids=[f"e{i}" for i in range(4)]))
    queries = less_query_features(model, _batches(x, y), options=CaptureOptions(layers=["net.6"], projection=sketch))
    plain = gradtrace.collect(model, _batches(x, y), options=CaptureOptions(layers=["net.6"]))
    with pytest.raises(SpecMismatch, match="less_features"):  # plain gradients as the training side
        gradtrace.Attributor("less", [plain]).score([queries])
    with pytest.raises(SpecMismatch, match="query features"):  # query features as the training side
        gradtrace.Attributor("less", [queries]).score([queries])
    with pytest.raises(SpecMismatch, match="different projections"):  # plain queries against LESS features
        gradtrace.Attributor("less", [feats]).score([plain])
    with pytest.raises(SpecMismatch, match="features='adam'"):  # query features into a training-feature store
        less_query_features(model, _batches(x, y), store=tmp_path / "train",
                            options=CaptureOptions(layers=["net.6"], projection=sketch),
                            store_options=StoreOptions(resume=True))
    with pytest.raises(SpecMismatch, match=r"collected with projection \{'kind': 'less'.*this run asks for None"):
        # plain gradients into a LESS store: refused before any gradient
        gradtrace.collect(model, _batches(x, y), store=tmp_path / "train", options=CaptureOptions(layers=["net.6"]),
                          store_options=StoreOptions(resume=True))
    # resuming with every example stored computes nothing and leaves the store complete
    again = less_features(model, partial, _batches(x, y), store=tmp_path / "train",
                          options=CaptureOptions(layers=["net.6"], projection=sketch),
                          store_options=StoreOptions(resume=True),
                          run=RunOptions(ids=[f"e{i}" for i in range(4)]))
    assert len(again) == 4 and again.complete


def test_less_features_of_lora_adapters_with_token_mean_loss():
    peft = pytest.importorskip("peft")
    from tests.capture.test_exact import _lm_batch

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny.llama(), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(3):
        _, ids, mask, labels, pos = _lm_batch([6, 4, 7])
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels, mean=True).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 3, 6])
    batches = [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2], "position_ids": pos[i:i + 2],
                "labels": labels[i:i + 2]} for i in (0, 2)]
    sketch = DenseProjection(16, seed=2)
    # default: token-mean loss
    feats = less_features(model, optimizer.state_dict(), batches, options=CaptureOptions(projection=sketch))
    names = [n for n, _ in feats.spec.projection["inputs"]]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad] and len(names) == 8

    def row_loss(m, row):
        return tiny.lm_example_loss(m(input_ids=row.unsqueeze(0)).logits, row.unsqueeze(0), mean=True).sum()

    ref = tiny.reference_grads(model, rows, row_loss)
    grads = {n: ref[n].reshape(len(rows), -1).double() for n in names}
    want = _sketched(_adam_by_hand(grads, optimizer, dict(model.named_parameters()), names), sketch)
    _close(feats.vectors, want)
    assert feats.spec.convention["example_loss"] == "mean"
