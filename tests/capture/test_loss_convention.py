"""One loss convention: a captured gradient is the gradient of the example's own loss, whatever the loop's
reduction; the same example gets the same gradient in any batch, with either padding side."""

import pytest
import torch

import gradtrace
from gradtrace.options import Loss
from tests import tiny
from tests.capture.test_exact import _lm_batch


def _single(mean):
    def loss(model, row):
        ids = row.unsqueeze(0)
        return tiny.lm_example_loss(model(input_ids=ids).logits, ids, mean=mean).sum()

    return loss


LOOPS = {
    # name: (capture kwargs, loss of the batch)
    "mean": (dict(reduction="mean"), lambda out, labels, n: tiny.lm_example_loss(out.logits, labels).mean()),
    "sum": (dict(reduction="sum"), lambda out, labels, n: tiny.lm_example_loss(out.logits, labels).sum()),
    "hf-token-mean": (dict(reduction="token_mean"), lambda out, labels, n: out.loss),
    "sum-times-3": (dict(reduction="sum", scale=3.0),
                    lambda out, labels, n: 3 * tiny.lm_example_loss(out.logits, labels).sum()),
}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("example_loss", ["sum", "mean"])
def test_reductions_give_example_loss_gradients(loop, example_loss):
    model = tiny.llama()
    rows, ids, mask, labels, pos = _lm_batch([4, 8, 6])
    ref = tiny.reference_grads(model, rows, _single(example_loss == "mean"))
    kwargs, batch_loss = LOOPS[loop]
    with gradtrace.capture(model, Loss(example_loss=example_loss, **kwargs)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        batch_loss(out, labels, None).backward()
    batch = cap.batches[0]
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    assert batch.convention.example_loss == example_loss
    targets = torch.tensor([3.0, 7.0, 5.0])
    assert torch.equal(batch.num_targets, targets)
    expected = {"mean": torch.full((3,), 3.0), "sum": torch.ones(3), "hf-token-mean": torch.full((3,), 15.0),
                "sum-times-3": torch.full((3,), 1 / 3)}[loop]
    if example_loss == "mean":
        expected = expected / targets
    assert torch.allclose(batch.scale, expected)


def test_num_items_in_batch_with_accumulation():
    """Hugging Face Trainer: loss = sum / num_items_in_batch over all micro-batches of a step."""
    model = tiny.gpt2()
    rows, ids, mask, labels, pos = _lm_batch([4, 8, 6, 5])
    ref = tiny.reference_grads(model, rows, _single(False))
    n_items = int((labels[:, 1:] != -100).sum())
    with gradtrace.capture(model, loss=Loss(reduction="token_mean")) as cap:
        for part in (slice(0, 2), slice(2, 4)):
            out = model(input_ids=ids[part], attention_mask=mask[part], position_ids=pos[part], labels=labels[part],
                         num_items_in_batch=torch.tensor(n_items))
            out.loss.backward()
    assert len(cap.batches) == 2
    got = {n: torch.cat([b.per_example_grads()[n] for b in cap.batches]) for n in ref}
    tiny.assert_grads_close(got, ref)
    assert torch.allclose(cap.batches[0].scale, torch.full((2,), float(n_items)))


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_same_example_same_gradient_in_any_batch(pad_side):
    model = tiny.gpt2()
    probe = torch.randint(1, tiny.VOCAB, (6,))
    results = []
    for size in (1, 4, 16):
        lengths = [6] + [int(n) for n in torch.randint(2, 12, (size - 1,))]
        rows, ids, mask, labels, pos = _lm_batch(lengths, pad_side)
        ids[0] = ids[0].masked_scatter(mask[0].bool(), probe)
        labels = ids.masked_fill(mask == 0, -100)
        labels[torch.arange(size), mask.argmax(1)] = -100
        with gradtrace.capture(model, loss=Loss(reduction="token_mean")) as cap:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
        batch = cap.batches[0]
        results.append((batch.ids[0], batch.per_example_grads()))
    ids0 = {r[0] for r in results}
    assert len(ids0) == 1, "the content id does not depend on the batch or padding"
    for _, grads in results[1:]:
        tiny.assert_grads_close({n: g[:1] for n, g in grads.items()}, {n: g[:1] for n, g in results[0][1].items()})


def test_left_and_right_padding_agree():
    model = tiny.llama()
    out = {}
    for side in ("left", "right"):
        torch.manual_seed(3)
        rows, ids, mask, labels, pos = _lm_batch([3, 7, 5], side)
        with gradtrace.capture(model, loss=Loss(reduction="sum")) as cap:
            tiny.lm_example_loss(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
                                 labels).sum().backward()
        out[side] = cap.batches[0]
    assert out["left"].ids == out["right"].ids
    tiny.assert_grads_close(out["left"].per_example_grads(), out["right"].per_example_grads())


def test_token_mean_without_labels_is_a_clear_error():
    model = tiny.gpt2()
    ids = torch.randint(1, tiny.VOCAB, (2, 5))
    with gradtrace.capture(model, loss=Loss(reduction="token_mean")), pytest.raises(ValueError, match="token_mean"):
        model(input_ids=ids)
