"""Module- and token-level attribution of top-k pairs: exact decompositions, equal to brute force."""

import math

import pytest
import torch

import gradtrace
from gradtrace.options import CaptureOptions
from gradtrace.score.pairs import map_condition
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


def _token_vectors(token_set) -> dict[str, torch.Tensor]:
    """Brute force: ``{id: [T, D]}`` per-token gradient vectors, each captured batch's terms materialized token by
    token (a layer used ``m`` times per forward -- GPT-2's tied embedding -- folded onto the batch's token
    positions), in the spec's parameter order."""
    out = {}
    for batch in token_set.batches:
        length = batch.num_tokens
        parts = []
        for name, _ in token_set.spec.params:
            total = 0
            for term in batch.params[name].terms:
                per_token = term.token_materialize().double().reshape(len(batch), -1, batch.params[name].numel)
                if per_token.shape[1] != length:
                    per_token = per_token.reshape(len(batch), -1, length, per_token.shape[2]).sum(1)
                total = total + per_token
            parts.append(total)
        out.update(zip(batch.ids, torch.cat(parts, dim=2)))
    vectors = torch.stack([out[i].sum(0) for i in token_set.ids])
    torch.testing.assert_close(vectors, token_set.vectors.double(), rtol=1e-5, atol=1e-6)  # the layout is right
    return out


def _own_width(batches):
    """Each batch cut to its own longest example: batches of different token widths (the token layout of a
    layer used twice per forward, GPT-2's tied embedding, then differs between batches)."""
    out = []
    for batch in batches:
        keep = batch["attention_mask"].bool().any(0)
        out.append({key: value[:, keep] for key, value in batch.items()})
    return out


def _tok_setup(method, projection, seed=1):
    model = tiny.gpt2()
    train_batches = _own_width(_data([5, 8, 3, 7, 6], seed=seed)[1])
    query_batches = _own_width(_data([6, 4, 7], seed=2, batch_size=2)[1])
    assert [b["input_ids"].shape[1] for b in train_batches] == [8, 7]
    train = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=projection, keep_tokens=True))
    queries = gradtrace.collect(model, query_batches, options=CaptureOptions(projection=projection, keep_tokens=True))
    attributor = gradtrace.Attributor(method, train, **({"fisher": "empirical"} if method == "kfac" else {}))
    if method == "kfac":
        attributor.fit(model, train_batches)
    return model, train, queries, attributor


@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=4)], ids=["exact", "logra"])
@pytest.mark.parametrize("method", ["grad_dot", "grad_cos", "kfac"])
def test_tokens_sum_to_score_and_equal_brute_force(method, projection):
    _, train, queries, attributor = _tok_setup(method, projection)
    scores = attributor.score(queries, topk=2, matrix=True)
    records = attributor.token_attributions(queries, scores, train_tokens=train)
    assert scores.meta["tokens"] is records and len(records) == len({(r["query_id"], r["train_id"]) for r in records})
    query_tokens, train_tokens = _token_vectors(queries), _token_vectors(train)  # {id: [T, D]}
    method_ = attributor.method
    condition = map_condition(method_)
    assert (condition == 1.0) == (method != "kfac")
    prepared = method_.prepare_queries(queries.vectors).double()  # [Q, D]
    rows = method_.prepare_train(train.vectors).double()  # [N, D]
    for record in records:
        q, i = queries.ids.index(record["query_id"]), train.ids.index(record["train_id"])
        total = float(scores.matrix[q, i])
        if method == "grad_cos":  # the query map is a normalization: g_qt / |g_q|
            want_q = query_tokens[record["query_id"]] @ rows[i] / queries.vectors[q].double().norm()
            want_t = train_tokens[record["train_id"]] @ prepared[q] / train.vectors[i].double().norm()
        else:  # a linear map, applied to each token's gradient (no symmetry assumed here)
            want_q = method_.prepare_queries(query_tokens[record["query_id"]].float()).double() @ rows[i]
            want_t = train_tokens[record["train_id"]] @ prepared[q]
        got = scores.tokens(record["query_id"], record["train_id"])
        for side, want in (("query", want_q), ("train", want_t)):
            values = torch.tensor(got[f"{side}_scores"], dtype=torch.float64)
            assert got[f"{side}_tokens"] == [str(t) for t in range(len(values))]
            magnitude = (values.abs().sum() + abs(total)).item()
            # float32 token products of D terms, and float32 sums over T tokens
            bound = 4 * EPS32 * (prepared.shape[1] + len(values)) * magnitude
            want = torch.cat([want, want.new_zeros(len(values) - len(want))])  # shorter batches: padded on the right
            assert torch.allclose(values, want, rtol=0, atol=bound), (side, record)
            # the sum: float32 summation over T tokens, plus the round-off of computing the parts and the total in
            # two ways (dot products over D values, sqrt(D) eps; the query map on the query for the total, on the
            # training row for the parts: amplified by its condition number)
            allowed = 4 * EPS32 * (len(values) + condition * math.sqrt(prepared.shape[1])) * magnitude
            assert record[f"{side}_tolerance"] <= allowed * (1 + 1e-9), (side, record)
            assert abs(values.sum().item() - total) <= record[f"{side}_tolerance"], (side, record)


def test_tokens_of_a_store_from_recaptured_rows(tmp_path):
    model, train, queries, attributor = _tok_setup("grad_dot", gradtrace.LoGra(rank=4))
    store = train.save(tmp_path / "store")
    attributor = gradtrace.Attributor("grad_dot", store, block_rows=2)
    scores = attributor.score(queries, topk=1, matrix=False)
    kept = sorted({tid for r in scores.to_records(1) for tid in [r["train_id"]]}
                  | {tid for r in scores.to_records(1, largest=False) for tid in [r["train_id"]]})
    # re-capture only the pairs' training examples, in other batches than the store was written with
    _, batches = _data([5, 8, 3, 7, 6], seed=1, batch_size=1)
    rows = [b for b in batches if gradtrace.collect(model, [b]).ids[0] in kept]
    recaptured = gradtrace.collect(model, rows,
                                   options=CaptureOptions(projection=gradtrace.LoGra(rank=4), keep_tokens=True))
    assert sorted(recaptured.ids) == kept and len(recaptured) < len(train)
    tokens = {ident: [f"tok{n}" for n in range(3)] for ident in [*queries.ids, *kept]}
    attributor.token_attributions(queries, scores, train_tokens=recaptured, tokens=tokens)
    loaded = gradtrace.Scores.load(scores.save(tmp_path / "scores"))
    record = loaded.tokens(loaded.query_ids[0], loaded.topk(1).ids[0][0])
    assert record["train_tokens"] == ["tok0", "tok1", "tok2"] and len(record["query_scores"]) == 3
    with pytest.raises(ScoresError, match="--tokens"):
        gradtrace.Attributor("grad_dot", store).score(queries, topk=1).tokens(loaded.query_ids[0], "x")


def test_tokens_refuse_gradients_that_do_not_add_up():
    model, train, queries, attributor = _tok_setup("grad_dot", None)
    scores = attributor.score(queries, topk=2, matrix=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # other weights than the store's
    _, batches = _data([5, 8, 3, 7, 6], seed=1)
    other = gradtrace.collect(model, batches, options=CaptureOptions(keep_tokens=True))
    with pytest.raises(ValueError, match=r"training-side token shares of query .* re-captured gradient"):
        attributor.token_attributions(queries, scores, query_side=False, train_tokens=other)
    plain = gradtrace.collect(tiny.gpt2(), _data([6, 4, 7], seed=2)[1])
    with pytest.raises(ValueError, match="keep_tokens=True"):
        gradtrace.Attributor("grad_dot", train).token_attributions(plain, gradtrace.Attributor(
            "grad_dot", train).score(plain, topk=1))
