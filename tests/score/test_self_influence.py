"""``Attributor.self_scores(normalize="length")``: the self-influence of each example's mean loss per target token,
against brute force (one backward pass of the mean loss per example) and the hand count of target tokens."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from tests import tiny
from tests.score.test_scoring import _data


def _mean_loss(model, row):
    ids = row.unsqueeze(0)
    return tiny.lm_example_loss(model(input_ids=ids).logits, ids, mean=True).sum()


@pytest.mark.parametrize("to_store", [False, True], ids=["memory", "store"])
def test_length_normalized_self_scores_equal_brute_force(tmp_path, to_store):
    model = tiny.gpt2()
    rows, batches = _data([5, 8, 3])
    train = gradtrace.collect(model, batches, store=tmp_path / "s" if to_store else None)
    targets = [4, 7, 2]  # a row of n tokens predicts its last n - 1
    assert train.field("num_targets") == targets
    ref = tiny.reference_grads(model, rows, _mean_loss)
    mean_grads = torch.cat([ref[name].reshape(len(rows), -1) for name, _ in train.spec.params], dim=1)
    attr = gradtrace.Attributor("grad_dot", train)
    # |g / n|^2 = |g|^2 / n^2: two float32 summation orders of a few thousand terms, relative error well under 1e-4
    torch.testing.assert_close(attr.self_scores(normalize="length"), mean_grads.pow(2).sum(1), rtol=1e-4, atol=0)
    # the same raw sums divided by an exact integer square: one float32 rounding on each side (<= 2 eps = 2.4e-7)
    torch.testing.assert_close(attr.self_scores(normalize="length"),
                               attr.self_scores() / torch.tensor(targets, dtype=torch.float32) ** 2, rtol=1e-6, atol=0)
    # cosine is scale-free: 1 either way (a few sqrt(D) eps of float32 round-off)
    torch.testing.assert_close(gradtrace.Attributor("grad_cos", train).self_scores(normalize="length"),
                               torch.ones(3), rtol=1e-4, atol=0)


def test_length_normalization_needs_recorded_counts(tmp_path):
    model = tiny.MLP()
    data = [(torch.randn(4, 7), torch.randint(0, 4, (4,)))]
    store = gradtrace.collect(model, data, store=tmp_path / "s")  # a classifier's loss: no target-token count
    attr = gradtrace.Attributor("grad_dot", store)
    with pytest.raises(ValueError, match=r"do not record num_targets.*normalize='none'"):
        attr.self_scores(normalize="length")
    with pytest.raises(ValueError, match="'none' or 'length'"):
        attr.self_scores(normalize="tokens")
    assert attr.self_scores().shape == (4,)
