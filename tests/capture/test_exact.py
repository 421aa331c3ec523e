"""Per-example gradients equal a loop of single-example backward passes (fp32)."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions
from tests import tiny


def _lm_batch(lengths, pad_side="right", vocab=tiny.VOCAB, pad_id=0):
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_id)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    rows = [torch.randint(1, vocab, (n,)) for n in lengths]
    for i, (n, row) in enumerate(zip(lengths, rows)):
        sl = slice(0, n) if pad_side == "right" else slice(T - n, T)
        ids[i, sl] = row
        mask[i, sl] = 1
    labels = ids.masked_fill(mask == 0, -100)
    first = mask.argmax(1)  # a row's first token is never a target (nothing precedes it)
    labels[torch.arange(len(lengths)), first] = -100
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return rows, ids, mask, labels, pos


def _lm_single_loss(model, row):
    ids = row.unsqueeze(0)
    logits = model(input_ids=ids).logits
    return tiny.lm_example_loss(logits, ids).sum()


@pytest.mark.parametrize("make", [lambda: tiny.gpt2(tied=True), lambda: tiny.llama(tied=True),
                                  lambda: tiny.llama(tied=False)], ids=["gpt2-tied", "llama-tied", "llama-untied"])
@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_causal_lm_matches_loop(make, pad_side):
    model = make()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 3, 7], pad_side)
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    assert len(cap.batches) == 1
    batch = cap.batches[0]
    assert cap.report().ok, str(cap.report())
    assert set(batch.params) == set(tiny.trainable(model)), "every trainable parameter is captured"
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    assert torch.allclose(batch.scale, torch.full((4,), 4.0))


def test_gpt2_tied_embedding_sums_both_sites():
    model = tiny.gpt2(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    with gradtrace.capture(model) as cap:
        pass
    kinds = {type(t).__name__ for t in []}
    del kinds
    report = str(cap.report())
    assert "lm_head" in report and "transformer.wte" in report


def test_bert_padded_classifier_matches_loop():
    model = tiny.bert_classifier()
    rows, ids, mask, _, _ = _lm_batch([6, 3, 8, 2, 5])
    labels = torch.randint(0, 3, (5,))

    def single(model, example):
        row, label = example
        logits = model(input_ids=row.unsqueeze(0)).logits
        return F.cross_entropy(logits, label.view(1), reduction="sum")

    ref = tiny.reference_grads(model, list(zip(rows, labels)), single)
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask)
        F.cross_entropy(out.logits, labels).backward()
    batch = cap.batches[0]
    assert set(batch.params) == set(tiny.trainable(model))
    tiny.assert_grads_close(batch.per_example_grads(), ref)


@pytest.mark.parametrize("make,shape", [(tiny.MLP, (7,)), (tiny.ConvNet, (2, 8, 8))], ids=["mlp", "convnet"])
def test_vision_style_models_match_loop(make, shape):
    model = make()
    x = torch.randn(6, *shape)
    y = torch.randint(0, 3, (6,))
    ref = tiny.reference_grads(model, list(zip(x, y)),
                               lambda m, e: F.cross_entropy(m(e[0].unsqueeze(0)), e[1].view(1), reduction="sum"))
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        F.cross_entropy(model(x), y).backward()
    batch = cap.batches[0]
    assert set(batch.params) == set(tiny.trainable(model))
    tiny.assert_grads_close(batch.per_example_grads(), ref)
