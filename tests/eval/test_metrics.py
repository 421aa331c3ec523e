"""Metrics against brute-force Python computations, with ties, undefined queries and known answers."""

import math
import random

import pytest
import torch

import gradtrace
from gradtrace.eval import lds, loo_correlation, recall_at_k, summarize


def _ranks(values):
    """Average ranks (ties share their mean rank), in plain Python."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def _pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else math.nan


def _spearman(a, b):
    return _pearson(_ranks(a), _ranks(b))


def _lds_brute(scores, masks, outcomes):
    out = []
    for q in range(len(scores)):
        preds = [sum(scores[q][i] for i in range(len(mask)) if mask[i]) for mask in masks]
        out.append(_spearman(preds, [row[q] for row in outcomes]))
    return out


def _mean_se(values):
    vals = [v for v in values if not math.isnan(v)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return mean, std / math.sqrt(len(vals))


def test_lds_equals_brute_force_with_ties():
    gen = torch.Generator().manual_seed(0)
    num_q, num_train, num_s = 5, 12, 15
    scores = torch.randint(-2, 3, (num_q, num_train), generator=gen).float()  # ties among predictions
    masks = torch.rand(num_s, num_train, generator=gen) < 0.5
    outcomes = torch.randint(0, 4, (num_s, num_q), generator=gen).double()  # ties among outcomes
    got = lds(scores, masks, outcomes)
    want = _lds_brute(scores.tolist(), masks.tolist(), outcomes.tolist())
    assert torch.allclose(got.per_query, torch.tensor(want, dtype=torch.float64), atol=1e-12, equal_nan=True)
    mean, se = _mean_se(want)
    assert got.mean == pytest.approx(mean) and got.se == pytest.approx(se)
    assert got.n == num_q


def test_lds_is_one_for_a_monotone_linear_datamodel():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 30, generator=gen)
    masks = torch.rand(40, 30, generator=gen) < 0.5
    outcomes = torch.exp(masks.double() @ scores.double().t())  # any increasing function of the prediction
    result = lds(scores, masks, outcomes)
    assert torch.allclose(result.per_query, torch.ones(4, dtype=torch.float64))
    assert result.mean == pytest.approx(1.0) and result.se == pytest.approx(0.0)
    assert lds(-scores, masks, outcomes).mean == pytest.approx(-1.0)  # the sign matters


def test_lds_of_unrelated_scores_is_near_zero():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(400, 50, generator=gen)
    masks = torch.rand(100, 50, generator=gen) < 0.5
    outcomes = torch.randn(100, 400, generator=gen)
    result = lds(scores, masks, outcomes)
    assert abs(result.mean) < 3 * result.se + 1e-3
    assert abs(result.mean) < 0.03
    assert result.se == pytest.approx(float(result.per_query.std()) / 20)


def test_lds_takes_scores_and_skips_undefined_queries():
    gen = torch.Generator().manual_seed(3)
    matrix = torch.randn(3, 10, generator=gen)
    scores = gradtrace.Scores(train_ids=[str(i) for i in range(10)], query_ids=["a", "b", "c"], method="x",
                              matrix=matrix)
    masks = torch.rand(8, 10, generator=gen) < 0.5
    outcomes = torch.randn(8, 3, generator=gen)
    outcomes[:, 1] = 0.25  # constant: no correlation defined
    result = lds(scores, masks, outcomes)
    assert math.isnan(result.per_query[1]) and result.n == 2
    assert result.mean == pytest.approx(float(result.per_query[[0, 2]].mean()))
    with pytest.raises(ValueError, match="masks"):
        lds(matrix, masks[:, :9], outcomes)
    with pytest.raises(ValueError, match="bool"):
        lds(matrix, masks.float(), outcomes)
    with pytest.raises(ValueError, match="outcomes"):
        lds(matrix, masks, outcomes.t())


@pytest.mark.parametrize("kind", ["pearson", "spearman"])
def test_loo_correlation_equals_brute_force(kind):
    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(-3, 4, (6, 9), generator=gen).float()
    effects = scores + torch.randint(-2, 3, (6, 9), generator=gen).float()
    got = loo_correlation(scores, effects, kind=kind)
    ref = _pearson if kind == "pearson" else _spearman
    want = [ref(s, e) for s, e in zip(scores.tolist(), effects.tolist())]
    assert torch.allclose(got.per_query, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert got.mean == pytest.approx(_mean_se(want)[0]) and got.se == pytest.approx(_mean_se(want)[1])
    with pytest.raises(ValueError, match="kind"):
        loo_correlation(scores, effects, kind="kendall")


def test_recall_at_k_by_index_and_by_id():
    matrix = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.0, 0.8, 0.7, 0.6], [1.0, 2.0, 3.0, 4.0]])
    relevant = [{0, 3}, {2}, set()]
    result = recall_at_k(matrix, relevant, k=2)
    assert result.per_query[:2].tolist() == [0.5, 1.0] and math.isnan(result.per_query[2])
    assert result.mean == pytest.approx(0.75) and result.n == 2
    ids = ["a", "b", "c", "d"]
    scores = gradtrace.Scores(train_ids=ids, query_ids=["q0", "q1", "q2"], method="x", matrix=matrix)
    by_id = recall_at_k(scores, [{"a", "d"}, ["c"], []], k=2)
    assert torch.equal(by_id.per_query.nan_to_num(-1), result.per_query.nan_to_num(-1))
    # brute force on a random case
    rng = random.Random(0)
    matrix = torch.randn(7, 20, generator=torch.Generator().manual_seed(5))
    relevant = [set(rng.sample(range(20), rng.randint(1, 5))) for _ in range(7)]
    got = recall_at_k(matrix, relevant, k=5)
    for q in range(7):
        top = sorted(range(20), key=lambda i: -matrix[q, i].item())[:5]
        assert got.per_query[q] == pytest.approx(len(relevant[q] & set(top)) / len(relevant[q]))
    with pytest.raises(ValueError, match="ids"):
        recall_at_k(matrix, [{"a"}] * 7, k=5)
    with pytest.raises(ValueError, match="not a training id"):
        recall_at_k(scores, [{"zzz"}, set(), set()], k=1)


def test_summarize_is_mean_and_standard_error():
    values = torch.tensor([0.1, 0.4, float("nan"), 0.7, 0.2])
    result = summarize(values)
    mean, se = _mean_se(values.tolist())
    assert result.mean == pytest.approx(mean) and result.se == pytest.approx(se) and result.n == 4
    assert str(result) == f"{mean:.3f} ± {se:.3f}"
    assert math.isnan(summarize(torch.tensor([0.5])).se)
