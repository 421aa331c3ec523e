"""Module- and token-level attribution of top-k pairs: exact decompositions, equal to brute force."""

import pytest
import torch

import gradtrace
from gradtrace.score.scores import ScoresError
from tests import tiny
from tests.score.test_scoring import _data

EPS32 = torch.finfo(torch.float32).eps


def _score_bound(query: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Worst-case float32 error of the engine's dot products ``query @ train.T``: ``D * eps * sum_d |q_d x_d|``."""
    return query.shape[1] * EPS32 * (query.abs().double() @ train.abs().double().t())


def _setup(method="grad_dot", **options):
    model = tiny.gpt2()
    _, train_batches = _data([5, 8, 3, 7, 6, 4, 9], seed=1)
    _, query_batches = _data([6, 4, 7], seed=2)
    train = gradtrace.collect(model, train_batches)
    queries = gradtrace.collect(model, query_batches)
    attributor = gradtrace.Attributor(method, train, block_rows=3, **options)
    if method == "kfac":
        attributor.fit(model, train_batches)
    return attributor, train, queries


@pytest.mark.parametrize("method", ["grad_dot", "grad_cos", "kfac"])
def test_modules_sum_to_score_and_equal_brute_force(method):
    attributor, train, queries = _setup(method, **({"fisher": "empirical"} if method == "kfac" else {}))
    scores = attributor.score(queries, topk=2, matrix=True)
    records = attributor.module_scores(queries, scores)
    assert scores.meta["modules"] is records
    prepared = attributor.method.prepare_queries(queries.vectors)  # preconditioned for kfac
    rows = attributor.method.prepare_train(train.vectors)
    bound = _score_bound(prepared, rows)
    pairs = {(r["query_id"], r["train_id"]) for r in records}
    top, bottom = scores.topk(2), scores.topk(2, largest=False)
    want = {(qid, tid) for q, qid in enumerate(scores.query_ids) for tid in top.ids[q] + bottom.ids[q]}
    assert pairs == want and len(records) == len(want)
    offsets = train.spec.offsets()
    for qid, tid in want:
        q, i = scores.query_ids.index(qid), scores.train_ids.index(tid)
        blocks = scores.modules(qid, tid)
        assert list(blocks) == list(offsets)
        for name, (start, stop) in offsets.items():  # brute force: one block's dot product in float64
            ref = float(prepared[q, start:stop].double() @ rows[i, start:stop].double())
            part_bound = (stop - start) * EPS32 * float(prepared[q, start:stop].abs().double()
                                                         @ rows[i, start:stop].abs().double())
            assert abs(blocks[name] - ref) <= part_bound + 1e-30, name
        assert abs(sum(blocks.values()) - float(scores.matrix[q, i])) <= float(bound[q, i])


def test_modules_tracin_weights_checkpoints():
    model = tiny.gpt2()
    _, batches = _data([5, 8, 3, 7])
    _, qbatches = _data([4, 6], seed=5)
    stores, queries = [], []
    for _ in range(2):
        stores.append(gradtrace.collect(model, batches))
        queries.append(gradtrace.collect(model, qbatches))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    attributor = gradtrace.Attributor("tracin", stores, weights=[0.1, 0.03])
    scores = attributor.score(queries, topk=1, matrix=True)
    attributor.module_scores(queries, scores)
    offsets = stores[0].spec.offsets()
    for record in scores.meta["modules"]:
        q, i = scores.query_ids.index(record["query_id"]), scores.train_ids.index(record["train_id"])
        for name, (start, stop) in offsets.items():
            ref = sum(w * float(qs.vectors[q, start:stop].double() @ ts.vectors[i, start:stop].double())
                      for w, qs, ts in zip([0.1, 0.03], queries, stores))
            assert record["modules"][name] == pytest.approx(ref, rel=1e-9, abs=1e-12)
        bound = sum(w * float(_score_bound(qs.vectors[q:q + 1], ts.vectors[i:i + 1]))
                    for w, qs, ts in zip([0.1, 0.03], queries, stores))
        assert abs(sum(record["modules"].values()) - float(scores.matrix[q, i])) <= 2 * bound


def test_modules_from_a_store_survive_save_and_load(tmp_path):
    attributor, train, queries = _setup()
    store = train.save(tmp_path / "store")
    attributor = gradtrace.Attributor("grad_dot", store, block_rows=3)
    scores = attributor.score(queries, topk=2, matrix=False)
    attributor.module_scores(queries, scores)
    loaded = gradtrace.Scores.load(scores.save(tmp_path / "scores"))
    qid, tid = scores.query_ids[0], scores.topk(1).ids[0][0]
    assert loaded.modules(qid, tid) == scores.modules(qid, tid)
    with pytest.raises(KeyError, match="top and bottom k"):
        loaded.modules(qid, "no-such-id")
    bare = gradtrace.Attributor("grad_dot", store).score(queries, topk=2)
    with pytest.raises(ScoresError, match="--modules"):
        bare.modules(qid, tid)
