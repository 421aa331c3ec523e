"""collect + Attributor + Scores: exact against brute force, streaming equals dense, bad input is refused."""

import pytest
import torch

import gradtrace
from gradtrace.fit.methods import MissingStage
from gradtrace.options import CaptureOptions, RunOptions, StoreOptions
from gradtrace.store import SpecMismatch
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss


def _data(lengths, batch_size=3, seed=0):
    torch.manual_seed(seed)
    rows, ids, mask, labels, pos = _lm_batch(lengths)
    batches = [{"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size],
                "position_ids": pos[i:i + batch_size], "labels": labels[i:i + batch_size]}
               for i in range(0, len(lengths), batch_size)]
    return rows, batches


def _flat_ref(model, rows, names):
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    return torch.cat([ref[n].reshape(len(rows), -1) for n in names], dim=1)


@pytest.mark.parametrize("make", [tiny.gpt2, tiny.llama], ids=["gpt2", "llama"])
def test_grad_dot_and_cos_equal_brute_force(make):
    model = make()
    train_rows, train_batches = _data([5, 8, 3, 7, 6, 4, 9], seed=1)
    query_rows, query_batches = _data([6, 4, 7], seed=2)
    train = gradtrace.collect(model, train_batches)
    queries = gradtrace.collect(model, query_batches)
    names = [n for n, _ in train.spec.params]
    g = _flat_ref(model, train_rows, names)
    q = _flat_ref(model, query_rows, names)
    dot = gradtrace.Attributor("grad_dot", train, block_rows=3).score(queries)
    assert torch.allclose(dot.matrix, q @ g.t(), rtol=1e-4, atol=1e-4 * float((q @ g.t()).abs().max()))
    cos = gradtrace.Attributor("grad_cos", train, block_rows=4).score(queries)
    want = (q / q.norm(dim=1, keepdim=True)) @ (g / g.norm(dim=1, keepdim=True)).t()
    assert torch.allclose(cos.matrix, want, rtol=1e-4, atol=1e-5)
    assert dot.train_ids == train.ids and dot.query_ids == queries.ids


def test_tracin_weights_checkpoints_by_learning_rate():
    model = tiny.gpt2()
    rows, batches = _data([5, 8, 3, 7])
    qrows, qbatches = _data([4, 6], seed=5)
    stores, queries, refs = [], [], []
    for _ in range(2):
        stores.append(gradtrace.collect(model, batches))
        queries.append(gradtrace.collect(model, qbatches))
        names = [n for n, _ in stores[-1].spec.params]
        refs.append(_flat_ref(model, qrows, names) @ _flat_ref(model, rows, names).t())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # the next checkpoint
    scores = gradtrace.Attributor("tracin", stores, weights=[0.1, 0.03]).score(queries)
    want = 0.1 * refs[0] + 0.03 * refs[1]
    assert torch.allclose(scores.matrix, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    with pytest.raises(MissingStage, match="learning rate"):
        gradtrace.Attributor("tracin", stores).score(queries)
    with pytest.raises(ValueError, match="one per training checkpoint"):
        gradtrace.Attributor("tracin", stores, weights=[1, 1]).score(queries[0])


def test_streaming_topk_equals_dense_topk(tmp_path):
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3, 7, 6, 4, 9, 5, 6, 7, 3], seed=3)
    _, qbatches = _data([4, 6, 5], seed=4)
    store = gradtrace.collect(model, batches, store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=4)),
                              store_options=StoreOptions(shard_rows=4))
    queries = gradtrace.collect(model, qbatches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    dense = gradtrace.Attributor("grad_dot", store, block_rows=100).score(queries, matrix=True, topk=None)
    streamed = gradtrace.Attributor("grad_dot", store, block_rows=3).score(queries, matrix=False, topk=4)
    assert streamed.matrix is None
    for largest in (True, False):
        a, b = dense.topk(4, largest), streamed.topk(4, largest)
        # blocks of 3 and 100 rows: other GEMM shapes, so float32 round-off may differ (~1e-6 relative)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5 * float(a.values.abs().max()))
        assert a.ids == b.ids
    with pytest.raises(ValueError, match="only the top 4"):
        streamed.topk(5)


def test_default_blocks_are_bounded_in_bytes_not_rows(tmp_path, monkeypatch):
    """Without block_rows a block holds the rows of BLOCK_BYTES of float32 (8,192 of 4,096 dims; 305 of a LoGra
    rank-64 GPT-2's 109,696 dims): the decode buffer is bounded by bytes whatever the store's length and width.
    With a budget of 3 rows the store streams in blocks of 3 and scores as with block_rows=3."""
    from gradtrace.common.units import BLOCK_BYTES, block_rows_for
    from gradtrace.score import engine

    assert block_rows_for(4096) == 8192 and block_rows_for(109_696) == 305 and block_rows_for(10**9) == 1
    spec = gradtrace.GradientSpec([("w", 70_000)], None, {"reduction": "sum", "example_loss": "sum"})
    wide = gradtrace.GradientSet(torch.zeros(2, 70_000), ["a", "b"], spec)
    assert gradtrace.Attributor("grad_dot", wide).block_rows == BLOCK_BYTES // (4 * 70_000) == 479
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3, 7, 6, 4, 9], seed=3)
    _, qbatches = _data([4, 6], seed=4)
    store = gradtrace.collect(model, batches, store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=4)),
                              store_options=StoreOptions(shard_rows=4))
    queries = gradtrace.collect(model, qbatches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    monkeypatch.setattr(engine, "block_rows_for", lambda dim: block_rows_for(dim, budget=3 * 4 * dim))
    auto = gradtrace.Attributor("grad_dot", store)
    assert auto.block_rows == 3
    got = auto.score(queries, matrix=True)
    want = gradtrace.Attributor("grad_dot", store, block_rows=3).score(queries, matrix=True)
    assert torch.equal(got.matrix, want.matrix)  # the same blocks: the same products, bit for bit
    assert gradtrace.plan_score(store, 2).block_rows == min(len(store), block_rows_for(store.dim))


def test_scores_save_load_and_exports(tmp_path):
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3, 7])
    train = gradtrace.collect(model, batches)
    scores = gradtrace.Attributor("grad_cos", train).score(train, topk=2)
    scores.save(tmp_path / "s")
    back = gradtrace.Scores.load(tmp_path / "s")
    assert torch.equal(back.matrix, scores.matrix) and back.train_ids == scores.train_ids
    assert back.meta["sign"].startswith("positive")
    import pandas as pd

    for suffix in (".csv", ".parquet", ".json"):
        scores.export(tmp_path / f"top{suffix}", k=2)
    frame = pd.read_csv(tmp_path / "top.csv")
    assert list(frame.columns) == ["query_id", "rank", "train_id", "score"] and len(frame) == 8
    parquet = pd.read_parquet(tmp_path / "top.parquet")
    assert parquet["score"].tolist() == pytest.approx(frame["score"].tolist())
    assert (frame.groupby("query_id")["rank"].min() == 1).all()
    # every example is its own best match under cosine similarity
    top1 = frame[frame["rank"] == 1]
    assert (top1["query_id"] == top1["train_id"]).all()


def test_collect_leaves_the_model_alone_and_weight_grads_agree():
    model = tiny.gpt2()
    model.train()
    _, batches = _data([5, 8, 3])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fast = gradtrace.collect(model, batches)
    full = gradtrace.collect(model, batches, run=RunOptions(weight_grads=True))
    assert torch.allclose(fast.vectors, full.vectors, atol=1e-6)
    assert model.training, "the model's mode is restored"
    assert all(p.grad is None for p in model.parameters()), "param.grad untouched"
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_per_token_scores_sum_to_scores():
    model = tiny.llama()
    _, batches = _data([5, 8, 3, 7])
    _, qbatches = _data([6, 4], seed=9)
    for projection in (None, gradtrace.LoGra(rank=4)):
        train = gradtrace.collect(model, batches, options=CaptureOptions(projection=projection, keep_tokens=True))
        queries = gradtrace.collect(model, qbatches, options=CaptureOptions(projection=projection))
        for method in ("grad_dot", "grad_cos"):
            attr = gradtrace.Attributor(method, train)
            scores = attr.score(queries)
            shares = attr.token_scores(queries, train_ids=train.ids)
            for (qid, tid), per_token in shares.items():
                want = scores.matrix[queries.ids.index(qid), train.ids.index(tid)]
                assert torch.allclose(per_token.sum(), want, rtol=1e-4, atol=1e-5), (method, qid, tid)


def test_self_scores():
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3])
    train = gradtrace.collect(model, batches)
    # two summation orders of a few thousand positive float32 terms: relative error well under 1e-4
    torch.testing.assert_close(gradtrace.Attributor("grad_dot", train).self_scores(), train.vectors.pow(2).sum(1),
                               rtol=1e-4, atol=0)
    # a float32 cosine of a row with itself over D values: a few sqrt(D) eps (~1e-5 here); 1e-4 leaves margin
    torch.testing.assert_close(gradtrace.Attributor("grad_cos", train).self_scores(), torch.ones(3),
                               rtol=1e-4, atol=0)


def test_bad_input(tmp_path):
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3])
    with pytest.raises(ValueError, match="no examples"):
        gradtrace.collect(model, [])
    long = {"input_ids": torch.randint(1, tiny.VOCAB, (1, 80))}
    with pytest.raises(ValueError, match="context is 64"):
        gradtrace.collect(model, [long])
    with pytest.raises(ValueError, match="ids given"):
        gradtrace.collect(model, batches, run=RunOptions(ids=["a"]))
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    queries = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=1)))
    with pytest.raises(SpecMismatch, match="different projections"):
        gradtrace.Attributor("grad_dot", train).score(queries)
    other_model = gradtrace.collect(tiny.llama(), [{"input_ids": torch.randint(1, tiny.VOCAB, (2, 5))}],
                                    options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    with pytest.raises(SpecMismatch, match="another model"):
        gradtrace.Attributor("grad_dot", train).score(other_model)
    with pytest.raises(ValueError, match="unknown method"):
        gradtrace.Attributor("nope", train)
    with pytest.raises(ValueError, match="loss_fn must return one loss per example"):
        gradtrace.collect(model, batches, loss=lambda m, b: m(input_ids=b["input_ids"]).logits.sum())


def test_collect_store_resume_when_everything_is_stored(tmp_path):
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3, 7])
    for b, start in zip(batches, (0, 3)):
        b["id"] = [f"ex{start + i}" for i in range(len(b["input_ids"]))]
    first = gradtrace.collect(model, batches, store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    again = gradtrace.collect(model, batches, store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=4)),
                              store_options=StoreOptions(resume=True))
    assert again.ids == first.ids and again.complete
    assert torch.equal(again.read(0, len(again)), first.read(0, len(first)))


def test_token_cross_entropy_matches_torch():
    import torch.nn.functional as F

    from gradtrace.loss.functions import token_cross_entropy

    logits = (torch.randn(37, 1000) * 3).requires_grad_()
    targets = torch.randint(0, 1000, (37,))
    targets[::5] = -100
    weights = torch.rand(37)
    ours = token_cross_entropy(logits, targets)
    (ours * weights).sum().backward()
    mine = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits, targets, reduction="none")
    (ref * weights).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5) and torch.allclose(mine, logits.grad, atol=1e-7)


def test_token_cross_entropy_consuming_the_logits():
    """consume_logits=True: the same loss and gradient, written into the logits' memory (no new [N, V] buffer);
    a second backward through the graph is refused by autograd rather than computed from overwritten logits."""
    import torch.nn.functional as F

    from gradtrace.loss.functions import token_cross_entropy

    weight = torch.randn(64, 1000, requires_grad=True)
    hidden = torch.randn(37, 64)
    targets = torch.randint(0, 1000, (37,))
    targets[::5] = -100
    ref = F.cross_entropy(hidden @ weight, targets, reduction="none")
    want_grad, = torch.autograd.grad(ref.sum(), weight)
    logits = hidden @ weight
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr() == logits.data_ptr()))
    ours = token_cross_entropy(logits, targets, consume_logits=True)
    got_grad, = torch.autograd.grad(ours.sum(), weight, retain_graph=True)
    assert torch.allclose(ours, ref, atol=1e-5) and torch.allclose(got_grad, want_grad, atol=1e-5)
    assert seen == [True], "the gradient reuses the logits' memory"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(ours.sum(), weight)


def test_token_cross_entropy_keeps_logits_another_backward_step_reads():
    """consume_logits=True never overwrites logits that their producer's backward reads (tanh keeps its output):
    those get a new buffer; soft-capped logits (tanh, then a product) are consumed. Gradients exact either way."""
    import torch.nn.functional as F

    from gradtrace.loss.functions import token_cross_entropy

    weight = torch.randn(64, 300, requires_grad=True)
    hidden = torch.randn(11, 64)
    targets = torch.randint(0, 300, (11,))
    for make in (lambda: (hidden @ weight).tanh(), lambda: (hidden @ weight).tanh() * 3):
        want, = torch.autograd.grad(F.cross_entropy(make(), targets, reduction="none").sum(), weight)
        logits = make()
        before = logits.detach().clone()
        got, = torch.autograd.grad(token_cross_entropy(logits, targets, consume_logits=True).sum(), weight)
        assert torch.allclose(got, want, atol=1e-5)
        overwritten = not torch.equal(logits.detach(), before)
        assert overwritten == (logits.grad_fn.name() == "MulBackward0")
