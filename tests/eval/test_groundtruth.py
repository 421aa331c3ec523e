"""The retraining ground truth on ridge regression (closed form): outcomes, runs, seeds, cache, LOO."""

import json

import pytest
import torch

from gradtrace.eval import GroundTruth, StaleGroundTruth, build_lds_ground_truth, build_loo_ground_truth, lds
from gradtrace.eval.groundtruth import fingerprint, subset_masks
from gradtrace.options.eval import LDSOptions


class Ridge:
    """Ridge regression in closed form; seed r shifts the weights by r * 0.01 (a stand-in for training noise)."""

    def __init__(self, n=30, d=4, q=5, lam=0.5, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=gen, dtype=torch.float64)
        self.w_true = torch.randn(d, generator=gen, dtype=torch.float64)
        self.y = self.x @ self.w_true + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
        self.xq = torch.randn(q, d, generator=gen, dtype=torch.float64)
        self.yq = self.xq @ self.w_true
        self.lam, self.n, self.d = lam, n, d
        self.calls = []

    def fit(self, indices, seed):
        x, y = self.x[indices], self.y[indices]
        w = torch.linalg.solve(x.t() @ x + self.lam * torch.eye(self.d, dtype=torch.float64), x.t() @ y)
        return w + 0.01 * seed

    def train(self, indices, seed):
        self.calls.append((indices.tolist(), seed))
        return self.fit(indices, seed)

    def outcome(self, w):
        return -((self.xq @ w - self.yq) ** 2)

    config = {"task": "ridge", "lam": 0.5}


def test_outcomes_match_closed_form_and_runs_average():
    task = Ridge()
    gt = build_lds_ground_truth(task.train, task.outcome, task.n,
                                options=LDSOptions(num_subsets=7, fraction=0.4, seed=3, runs=3))
    assert gt.masks.shape == (7, 30) and gt.masks.dtype == torch.bool and gt.outcomes.shape == (7, 5)
    assert (gt.masks.sum(1) == 12).all()
    assert torch.equal(gt.masks, subset_masks(30, 7, 0.4, seed=3))
    for s in range(7):
        idx = gt.masks[s].nonzero().flatten()
        want = sum(task.outcome(task.fit(idx, 3 + r)) for r in range(3)) / 3
        assert torch.allclose(gt.outcomes[s], want)
    assert sorted({seed for _, seed in task.calls}) == [3, 4, 5]  # run r uses seed + r for every subset
    assert len(task.calls) == 21


def test_seed_per_subset_and_masks_are_prefix_stable():
    task = Ridge()
    build_lds_ground_truth(task.train, task.outcome, task.n,
                           options=LDSOptions(num_subsets=4, runs=2, seed=10, seed_per_subset=True))
    assert [seed for _, seed in task.calls] == list(range(10, 18))
    assert torch.equal(subset_masks(30, 9, seed=1)[:4], subset_masks(30, 4, seed=1))
    assert not torch.equal(subset_masks(30, 4, seed=1), subset_masks(30, 4, seed=2))
    with pytest.raises(ValueError, match="0 < size"):
        subset_masks(30, 4, fraction=0.01)


def test_cache_round_trip_extension_and_refusal(tmp_path):
    task = Ridge()
    cache = tmp_path / "gt"
    first = build_lds_ground_truth(task.train, task.outcome, task.n, cache=cache, config=task.config,
                                   options=LDSOptions(num_subsets=6))
    assert len(task.calls) == 6
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["num_subsets"] == 6 and meta["settings"]["config"] == task.config and meta["fingerprint"]

    def refuse(indices, seed):
        raise AssertionError("a cached ground truth was retrained")

    loaded = build_lds_ground_truth(refuse, task.outcome, task.n, cache=cache, config=task.config,
                                    options=LDSOptions(num_subsets=6))
    assert torch.equal(loaded.masks, first.masks) and torch.equal(loaded.outcomes, first.outcomes)
    assert loaded.meta["fingerprint"] == first.meta["fingerprint"]
    fewer = build_lds_ground_truth(refuse, task.outcome, task.n, cache=cache, config=task.config,
                                   options=LDSOptions(num_subsets=4))
    assert torch.equal(fewer.outcomes, first.outcomes[:4])

    more = build_lds_ground_truth(task.train, task.outcome, task.n, cache=cache, config=task.config,
                                  options=LDSOptions(num_subsets=9))
    assert len(task.calls) == 9  # only the 3 new subsets were trained
    fresh = Ridge()
    want = build_lds_ground_truth(fresh.train, fresh.outcome, fresh.n, options=LDSOptions(num_subsets=9))
    assert torch.equal(more.masks, want.masks) and torch.allclose(more.outcomes, want.outcomes)
    assert GroundTruth.load(cache).num_subsets == 9

    with pytest.raises(StaleGroundTruth, match="lam"):
        build_lds_ground_truth(refuse, task.outcome, task.n, cache=cache, config={"task": "ridge", "lam": 1.0},
                               options=LDSOptions(num_subsets=6))
    with pytest.raises(StaleGroundTruth, match="fraction"):
        build_lds_ground_truth(refuse, task.outcome, task.n, cache=cache, config=task.config,
                               options=LDSOptions(num_subsets=6, fraction=0.3))
    with pytest.raises(ValueError, match="config"):
        build_lds_ground_truth(refuse, task.outcome, task.n, cache=cache, options=LDSOptions(num_subsets=6))


def test_interrupted_build_keeps_its_progress(tmp_path):
    task = Ridge()
    cache = tmp_path / "gt"

    def flaky(indices, seed):
        if len(task.calls) == 3:
            raise KeyboardInterrupt
        return task.train(indices, seed)

    with pytest.raises(KeyboardInterrupt):
        build_lds_ground_truth(flaky, task.outcome, task.n, cache=cache, config=task.config,
                               options=LDSOptions(num_subsets=5))
    assert GroundTruth.load(cache).num_subsets == 3
    done = build_lds_ground_truth(task.train, task.outcome, task.n, cache=cache, config=task.config,
                                  options=LDSOptions(num_subsets=5))
    assert len(task.calls) == 5
    fresh = Ridge()
    want = build_lds_ground_truth(fresh.train, fresh.outcome, fresh.n, options=LDSOptions(num_subsets=5))
    assert torch.allclose(done.outcomes, want.outcomes)


def test_bad_outcomes_are_refused():
    task = Ridge()
    with pytest.raises(ValueError, match=r"\[Q\]"):
        build_lds_ground_truth(task.train, lambda w: torch.zeros(2, 2), task.n, options=LDSOptions(num_subsets=2))
    with pytest.raises(ValueError, match="non-finite"):
        build_lds_ground_truth(task.train, lambda w: torch.full((3,), float("nan")), task.n,
                               options=LDSOptions(num_subsets=2))


def test_loo_effects_match_closed_form_and_sign():
    task = Ridge(n=12)
    # make training example 0 a copy of query 0 with its exact target: it helps that query
    task.x[0], task.y[0] = task.xq[0], task.yq[0]
    effects = build_loo_ground_truth(task.train, task.outcome, task.n, indices=[0, 3, 7], seeds=[0, 2])
    assert effects.shape == (5, 3)
    everything = torch.arange(12)
    for j, i in enumerate([0, 3, 7]):
        kept = torch.tensor([k for k in range(12) if k != i])
        want = sum(task.outcome(task.fit(everything, s)) - task.outcome(task.fit(kept, s)) for s in (0, 2)) / 2
        assert torch.allclose(effects[:, j], want)
    assert effects[0, 0] > 0


def test_ridge_linear_datamodel_has_high_lds():
    """For ridge, the exact leave-one-out effects summed over a subset predict its outcomes well."""
    task = Ridge(n=40, q=6)
    gt = build_lds_ground_truth(task.train, task.outcome, task.n, options=LDSOptions(num_subsets=30))
    effects = build_loo_ground_truth(task.train, task.outcome, task.n, indices=range(40))
    assert lds(effects, gt.masks, gt.outcomes).mean > 0.5
    assert lds(-effects, gt.masks, gt.outcomes).mean < -0.5


def test_subset_seed_draws_other_subsets_with_the_same_training_seeds(tmp_path):
    """A confirmation ground truth: other subsets, the same training seeds, cached apart from the first (a cache
    of one is refused for the other); without it the settings -- and the fingerprint of caches built before it
    existed -- are unchanged."""
    task = Ridge()
    first = build_lds_ground_truth(task.train, task.outcome, task.n, cache=tmp_path / "a", config=task.config,
                                   options=LDSOptions(num_subsets=4, seed=3))
    assert "subset_seed" not in first.meta["settings"]
    task.calls.clear()
    other = build_lds_ground_truth(task.train, task.outcome, task.n, cache=tmp_path / "b", config=task.config,
                                   options=LDSOptions(num_subsets=4, seed=3, subset_seed=8))
    assert torch.equal(other.masks, subset_masks(30, 4, seed=8)) and not torch.equal(other.masks, first.masks)
    assert {seed for _, seed in task.calls} == {3}
    for s in range(4):
        assert torch.equal(other.outcomes[s], task.outcome(task.fit(other.masks[s].nonzero().flatten(), 3)))
    with pytest.raises(StaleGroundTruth, match="subset_seed"):
        build_lds_ground_truth(task.train, task.outcome, task.n, cache=tmp_path / "a", config=task.config,
                               options=LDSOptions(num_subsets=4, seed=3, subset_seed=8))


# fingerprints of the ground truths the keyword form of build_lds_ground_truth wrote for Ridge().config on 30
# examples (computed with that code): a cache built then is recognised as built for the same settings
OLD_FINGERPRINTS = [
    ({}, "a1df0ebad80b20f8"),
    ({"fraction": 0.4, "seed": 3, "runs": 2, "seed_per_subset": True}, "ec1d6f195175ed23"),
    ({"seed": 3, "subset_seed": 8}, "0531cc06b83b30c8"),
]


@pytest.mark.parametrize("settings,key", OLD_FINGERPRINTS, ids=["defaults", "runs", "subset-seed"])
def test_the_options_give_the_fingerprint_caches_were_written_with(settings, key, tmp_path):
    task = Ridge()
    options = LDSOptions(num_subsets=3, **settings)
    built = build_lds_ground_truth(task.train, task.outcome, task.n, cache=tmp_path / "new", config=task.config,
                                   options=options)
    assert built.meta["fingerprint"] == key
    want = {"kind": "lds", "schema": 1, "config": task.config, "num_train": 30, "fraction": options.fraction,
            "seed": options.seed, "runs": options.runs, "seed_per_subset": options.seed_per_subset}
    if options.subset_seed is not None:
        want["subset_seed"] = options.subset_seed
    assert built.meta["settings"] == want and fingerprint(want) == key

    # a cache in the old layout (only what that code wrote) is reused, not retrained
    old = GroundTruth(built.masks, built.outcomes, {"schema": 1, "fingerprint": key, "settings": want})
    old.save(tmp_path / "old")

    def refuse(indices, seed):
        raise AssertionError("a cached ground truth was retrained")

    loaded = build_lds_ground_truth(refuse, task.outcome, task.n, cache=tmp_path / "old", config=task.config,
                                    options=LDSOptions(num_subsets=2, **settings))
    assert torch.equal(loaded.outcomes, built.outcomes[:2]) and torch.equal(loaded.masks, built.masks[:2])


@pytest.mark.parametrize("settings,message", [
    ({"num_subsets": 0}, "^num_subsets must be an integer >= 1, got 0$"),
    ({"fraction": 0.0}, r"^fraction must be a finite number in \(0, 1\], got 0.0$"),
    ({"fraction": float("nan")}, "^fraction must be"),
    ({"runs": 0}, "^runs must be an integer >= 1, got 0$"),
    ({"seed": 2**64}, "^seed must be a 64-bit integer"),
    ({"subset_seed": 1.5}, "^subset_seed must be a 64-bit integer"),
    ({"save_every_s": -1.0}, "^save_every_s must be a finite number >= 0, got -1.0$"),
])
def test_a_bad_lds_setting_is_refused_when_the_options_are_made(settings, message):
    with pytest.raises(ValueError, match=message):
        LDSOptions(**settings)
    with pytest.raises(TypeError, match="LDSOptions"):
        build_lds_ground_truth(Ridge().train, Ridge().outcome, 30, options=settings)
