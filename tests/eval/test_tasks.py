"""Tasks train deterministically, reach their accuracy, and describe themselves for cache fingerprints."""

import pytest
import torch

from gradtrace.eval import DigitsTask, TinyLMTask
from gradtrace.loss.functions import classification_loss


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_digits_trains_deterministically_and_accurately(digits_task):
    task = digits_task
    assert task.num_train == 1000 and task.num_queries == 100
    subset = torch.arange(0, 1000, 3)
    first, again = task.train(subset, seed=1), task.train(subset, seed=1)
    assert _same_weights(first, again)
    assert not _same_weights(first, task.train(subset, seed=2))
    assert task.accuracy() >= 0.9
    assert task.model is task.model  # trained once
    assert not task.model.training


def test_digits_batches_outcome_and_config(digits_task):
    task = digits_task
    batches = task.train_batches(300)
    assert [len(b["id"]) for b in batches] == [300, 300, 300, 100]
    assert [i for b in batches for i in b["id"]] == task.train_ids
    assert len(set(task.train_ids) | set(task.query_ids)) == 1100  # queries are held out
    queries = task.query_batches()[0]
    want = -classification_loss(task.model, (queries["inputs"], queries["labels"])).double()
    assert torch.allclose(task.outcome(task.model), want)
    assert task.config == DigitsTask().config
    assert task.config != DigitsTask(steps=299).config
    assert task.config["data"] != DigitsTask(split_seed=1).config["data"]


def test_digits_pixel_scalings(digits_task):
    from sklearn.datasets import load_digits

    raw = torch.tensor(load_digits().data, dtype=torch.float32)
    order = torch.randperm(len(raw), generator=torch.Generator().manual_seed(0))
    train_raw = raw[order[:1000]]
    standard = digits_task.x_train  # default: every pixel has the training set's zero mean and unit std
    varying = train_raw.std(0) > 0
    assert torch.allclose(standard.mean(0), torch.zeros(64), atol=1e-5)
    assert torch.allclose(standard.std(0)[varying], torch.ones(int(varying.sum())), atol=1e-4)
    unit = DigitsTask(pixels="unit")
    assert torch.equal(unit.x_train, train_raw / 16) and torch.equal(unit.x_query, raw[order[1000:1100]] / 16)
    glob = DigitsTask(pixels="global")  # one mean / std over all the training pixels
    assert torch.allclose(glob.x_train, (train_raw / 16 - (train_raw / 16).mean()) / (train_raw / 16).std())
    assert abs(float(glob.x_train.mean())) < 1e-5 and abs(float(glob.x_train.std()) - 1) < 1e-5
    assert len({t.config["data"] for t in (digits_task, unit, glob)}) == 3
    with pytest.raises(ValueError, match="unknown pixel scaling 'minmax'"):
        DigitsTask(pixels="minmax")


def test_tinylm_trains_deterministically():
    task = TinyLMTask(num_train=16, num_queries=4, epochs=2, batch_size=8, vocab_size=300, width=32)
    assert task.num_train == 16 and task.num_queries == 4 and not set(task.train_ids) & set(task.query_ids)
    subset = torch.arange(0, 16, 2)
    first = task.train(subset, seed=0)
    assert _same_weights(first, task.train(subset, seed=0))
    assert not _same_weights(first, task.train(subset, seed=1))
    outcome = task.outcome(first)
    assert outcome.shape == (4,) and (outcome < 0).all()
    batch = task.train_batches(5)[0]
    assert batch["input_ids"].shape[0] == 5 and batch["id"] == task.train_ids[:5]
    assert task.config == TinyLMTask(num_train=16, num_queries=4, epochs=2, batch_size=8, vocab_size=300,
                                     width=32).config


def test_tinylm_eager_model_is_the_same_model_with_a_forward_mode_derivative():
    task = TinyLMTask(num_train=8, num_queries=2, epochs=1, batch_size=4, vocab_size=300, width=32)
    eager = task.eager_model()
    assert eager.config._attn_implementation == "eager" and task.model.config._attn_implementation != "eager"
    assert _same_weights(task.model, eager)
    batch = task.query_batches()[0]
    with torch.no_grad():
        default, copy = task.loss_fn(task.model, batch), task.loss_fn(eager, batch)
    # the attention kernels round differently: float32 sums of a few dozen token losses agree to ~1e-6 relative
    torch.testing.assert_close(copy, default, rtol=1e-5, atol=0)
    params = dict(eager.named_parameters())
    tangents = {name: torch.ones_like(value) for name, value in params.items()}
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def logits_sum(values):
        return torch.func.functional_call(eager, values, (), inputs).logits.sum()

    value, derivative = torch.func.jvp(logits_sum, (params,), (tangents,))
    assert torch.isfinite(derivative) and torch.isfinite(value)
