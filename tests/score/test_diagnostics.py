"""The diagnostics computed with every score: the streamed distribution against the full matrix, the gradient
ratio against hand-made memorised and healthy gradients, the standout against planted and pure-noise scores."""

from __future__ import annotations

import math

import pytest
import torch

import gradtrace
from gradtrace.score.diagnostics import MEMORISED_BELOW, Diagnosis, diagnose, gradient_ratio
from gradtrace.score.distribution import expected_maximum
from gradtrace.store import GradientSpec

DIM = 24


def _set(rows: torch.Tensor, prefix: str) -> gradtrace.GradientSet:
    spec = GradientSpec([("synthetic.weight", DIM)], None, {"reduction": "sum", "example_loss": "sum"})
    return gradtrace.GradientSet(rows, [f"{prefix}{i}" for i in range(len(rows))], spec)


def _rows(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


def test_the_streamed_distribution_equals_the_full_matrix():
    train, queries = _set(_rows(103, 0), "t"), _set(_rows(5, 1), "q")
    scores = gradtrace.Attributor("grad_dot", train, block_rows=10).score(queries, topk=3, matrix=True)
    dist = scores.meta["distribution"]
    full = scores.matrix.double()
    assert dist["rows"] == 103
    # the stream and torch see the same float32 scores and both sum in float64, in another order: the mean differs
    # by at most N * eps64 * max|x|; var = E[x^2] - mean^2 loses kappa = E[x^2] / var in relative accuracy, so the
    # std differs by at most N * eps64 * kappa relatively (4x either for margin; independent of CPU, threads, BLAS)
    n, eps64 = full.shape[1], torch.finfo(torch.float64).eps
    mean_atol = 4 * n * eps64 * float(full.abs().max())
    kappa = float((full.square().mean(1) / full.var(1, correction=0)).max())
    torch.testing.assert_close(torch.tensor(dist["mean"], dtype=torch.float64), full.mean(1), rtol=0, atol=mean_atol)
    torch.testing.assert_close(torch.tensor(dist["std"], dtype=torch.float64), full.std(1, correction=0),
                               rtol=4 * n * eps64 * kappa, atol=0)


def test_the_distribution_survives_save_and_load(tmp_path):
    train, queries = _set(_rows(40, 0), "t"), _set(_rows(3, 1), "q")
    scores = gradtrace.Attributor("grad_cos", train).score(queries, topk=2)
    scores.save(tmp_path / "s")
    assert gradtrace.Scores.load(tmp_path / "s").meta["distribution"] == scores.meta["distribution"]


def test_expected_maximum_is_the_top_of_pure_noise():
    generator = torch.Generator().manual_seed(0)
    for rows in (100, 1_000, 10_000):
        draws = torch.randn(400, rows, generator=generator, dtype=torch.float64)
        z = (draws.max(1).values - draws.mean(1)) / draws.std(1, correction=0)
        # the mean of 400 maxima: its standard error is about 0.45 / sqrt(400) = 0.02 (so 0.1 is 4+ standard
        # errors); Blom's approximation is within 0.01; standardising by the sample's own mean and std lowers z by
        # about 1 / sqrt(N) at most
        assert abs(float(z.mean()) - expected_maximum(rows)) < 0.1 + 1 / math.sqrt(rows), rows


def test_a_memorised_training_set_is_named_with_the_fix():
    queries = _set(_rows(6, 1), "q")
    memorised = _set(_rows(200, 0, scale=0.01), "t")  # gradients 100x smaller than the queries'
    healthy = _set(_rows(200, 0), "t")
    assert gradient_ratio(memorised, queries) == pytest.approx(0.01, rel=0.2)
    assert gradient_ratio(healthy, queries) == pytest.approx(1.0, rel=0.2)
    low = diagnose(gradtrace.Attributor("grad_dot", memorised).score(queries, topk=3), train=memorised,
                   queries=queries)
    assert low.gradient_ratio[0] < MEMORISED_BELOW
    assert any("memorised its training set" in w and "--checkpoints-of" in w for w in low.warnings)
    fine = diagnose(gradtrace.Attributor("grad_dot", healthy).score(queries, topk=3), train=healthy,
                    queries=queries)
    assert not any("memorised" in w for w in fine.warnings)


def test_an_ensemble_names_only_the_members_that_memorised():
    queries = _set(_rows(6, 1), "q")
    members = [_set(_rows(50, 0, scale=0.01), "t"), _set(_rows(50, 0), "t")]
    ensemble = gradtrace.Ensemble("grad_dot", members)
    found = diagnose(ensemble.score([queries, queries], topk=3), train=members, queries=[queries, queries])
    assert found.gradient_ratio[0] < MEMORISED_BELOW < found.gradient_ratio[1]
    assert found.warnings == [w for w in found.warnings if "members [0]" in w or "stands out" in w]


def test_standout_separates_a_planted_top_from_noise():
    noise = _rows(500, 0)
    queries = _rows(8, 1)
    planted = noise.clone()
    planted[:8] = 6.0 * queries  # each query's own training row: a strong, clear match
    train_planted, train_noise, q = _set(planted, "t"), _set(noise, "t"), _set(queries, "q")
    clear = diagnose(gradtrace.Attributor("grad_cos", train_planted).score(q, topk=3))
    flat = diagnose(gradtrace.Attributor("grad_cos", train_noise).score(q, topk=3))
    assert min(clear.standout) > clear.noise + 1 and clear.flat == [] and not clear.warnings
    assert len(flat.flat) >= 6 and any("stands out" in w for w in flat.warnings)
    assert flat.rows == 500 and flat.noise == pytest.approx(expected_maximum(500))


def test_diagnosis_round_trips_and_prints():
    found = Diagnosis(rows=10, noise=1.5, standout=[3.0, 1.0], flat=["q1"], gradient_ratio=[0.5], warnings=["w"])
    assert Diagnosis.from_dict(found.to_dict()) == found
    lines = found.lines()
    assert "1 of 2 queries within noise" in lines[0] and "0.5" in lines[1]
    assert math.isfinite(expected_maximum(2)) and expected_maximum(1) == 0.0


def test_the_members_agreement_is_the_overlap_of_their_own_top_k():
    from gradtrace.score.agreement import overlap

    queries = _set(_rows(7, 1), "q")
    base = _rows(60, 0)
    members = [_set(base, "t"), _set(base + 0.5 * _rows(60, 5), "t"), _set(_rows(60, 9), "t")]  # 0~1, 2 apart
    scores = gradtrace.Ensemble("grad_dot", members, block_rows=16).score([queries] * 3, topk=10)
    tops = [gradtrace.Attributor("grad_dot", m).score(queries, topk=10).top[1] for m in members]
    want = [len(set(a.tolist()) & set(b.tolist())) / len(set(a.tolist()) | set(b.tolist()))
            for i, j in ((0, 1), (0, 2), (1, 2)) for a, b in zip(tops[i], tops[j])]
    agreement = scores.meta["agreement"]
    assert agreement["k"] == 10 and agreement["pairwise"] == pytest.approx(sum(want) / len(want), abs=1e-12)
    assert agreement["with_combined"] == pytest.approx([overlap(t, scores.top[1]) for t in tops], abs=1e-12)
    assert overlap(tops[0], tops[1]) > overlap(tops[0], tops[2])  # the related members agree more
    assert "overlap" in diagnose(scores).lines()[-1]
    single = gradtrace.Attributor("grad_dot", members[0]).score(queries, topk=3)
    assert "agreement" not in single.meta


def test_large_scores_do_not_overflow_the_distribution():
    """grad_dot scores above ~1.8e19 have float32 squares of inf: the sums of squares are taken in float64."""
    from gradtrace.score.distribution import ScoreDistribution

    dist = ScoreDistribution(1)
    dist.add(torch.tensor([[1e20, 3e20]], dtype=torch.float32))
    meta = dist.meta()
    assert meta["mean"][0] == pytest.approx(2e20, rel=1e-6) and meta["std"][0] == pytest.approx(1e20, rel=1e-6)
