"""Real training loops: accumulation, checkpointing, no-grad/eval forwards, several forwards per backward,
exceptions; the loop's own numbers never change under capture."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions, Loss
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss


def _train_steps(model, batches, use_capture, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []

    def run():
        for ids, mask, labels, pos in batches:
            loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()

    if use_capture:
        with gradtrace.capture(model, Loss(reduction="token_mean"), options=CaptureOptions(**kw)) as cap:
            run()
        return losses, grads, cap
    run()
    return losses, grads, None


@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=4)])
def test_capture_does_not_change_the_loop(projection):
    data = [_lm_batch([5, 8, 3])[1:] for _ in range(3)]
    base = tiny.gpt2()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    plain_losses, plain_grads, _ = _train_steps(base, data, False)
    model = tiny.gpt2()
    model.load_state_dict(state)
    losses, grads, cap = _train_steps(model, data, True, projection=projection)
    assert len(cap.batches) == 3
    for a, b in zip(plain_losses, losses):
        assert torch.equal(a, b)
    for ga, gb in zip(plain_grads, grads):
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


def test_gradient_accumulation_gives_one_batch_per_backward():
    model = tiny.llama()
    rows, ids, mask, labels, pos = _lm_batch([4, 6, 5, 7])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, loss=Loss(reduction="mean", scale=0.5)) as cap:
        for part in (slice(0, 2), slice(2, 4)):
            out = model(input_ids=ids[part], attention_mask=mask[part], position_ids=pos[part])
            (tiny.lm_example_loss(out.logits, labels[part]).mean() / 2).backward()
    assert [len(b) for b in cap.batches] == [2, 2]
    got = {n: torch.cat([b.per_example_grads()[n] for b in cap.batches]) for n in ref}
    tiny.assert_grads_close(got, ref)


@pytest.mark.parametrize("make", [tiny.gpt2, tiny.llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(make, reentrant):
    model = make()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 4])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    assert len(cap.batches) == 1
    tiny.assert_grads_close(cap.batches[0].per_example_grads(), ref)


def test_no_grad_and_eval_forwards_are_ignored():
    model = tiny.gpt2()
    rows, ids, mask, labels, pos = _lm_batch([5, 6])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model) as cap:
        with torch.no_grad():
            model(input_ids=ids[:1])
        model.eval()
        model(input_ids=ids, attention_mask=mask)  # grad-enabled forward that is never backpropagated
        model.train()
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
        with torch.no_grad():
            model(input_ids=ids)
    assert len(cap.batches) == 1
    tiny.assert_grads_close(cap.batches[0].per_example_grads(), ref)


def test_two_forwards_before_one_backward_concat():
    model = tiny.MLP()
    x, y = torch.randn(5, 7), torch.randint(0, 4, (5,))
    ref = tiny.reference_grads(model, list(zip(x, y)),
                               lambda m, e: F.cross_entropy(m(e[0][None]), e[1].view(1), reduction="sum"))
    with gradtrace.capture(model, loss=Loss(reduction="sum")) as cap:
        loss = F.cross_entropy(model(x[:2]), y[:2], reduction="sum") + F.cross_entropy(model(x[2:]), y[2:],
                                                                                       reduction="sum")
        loss.backward()
    batch = cap.batches[0]
    assert len(batch) == 5
    assert batch.meta["forward_call"] == [0, 0, 1, 1, 1]
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_two_forwards_before_one_backward_sum():
    """Two views of the same examples (e.g. clean and augmented): row i of both calls is one example."""
    model = tiny.MLP()
    x, y = torch.randn(4, 7), torch.randint(0, 4, (4,))
    noise = torch.randn(4, 7) * 0.1

    def pair_loss(m, xi, yi, ni):
        return F.cross_entropy(m(xi), yi, reduction="none") + F.cross_entropy(m(xi + ni), yi, reduction="none")

    ref = tiny.reference_grads(model, list(range(4)), lambda m, i: pair_loss(m, x[i:i + 1], y[i:i + 1],
                                                                             noise[i:i + 1]).sum())
    with gradtrace.capture(model, loss=Loss(reduction="mean"), options=CaptureOptions(multi_forward="sum")) as cap:
        pair_loss(model, x, y, noise).mean().backward()
    batch = cap.batches[0]
    assert len(batch) == 4
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_hooks_removed_even_when_the_loop_raises():
    model = tiny.gpt2()
    counts = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    before = counts()
    with pytest.raises(RuntimeError, match="boom"), gradtrace.capture(model):
        assert counts() > before
        raise RuntimeError("boom")
    assert counts() == before
    ids = torch.randint(1, tiny.VOCAB, (2, 4))
    model(input_ids=ids, labels=ids).loss.backward()  # no stale hooks fire


def test_module_called_twice_gets_the_sum():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(6, 6)
            self.out = torch.nn.Linear(6, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))

    model = Twice()
    x, y = torch.randn(5, 6), torch.randint(0, 2, (5,))
    ref = tiny.reference_grads(model, list(zip(x, y)),
                               lambda m, e: F.cross_entropy(m(e[0][None]), e[1].view(1), reduction="sum"))
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        F.cross_entropy(model(x), y).backward()
    tiny.assert_grads_close(cap.batches[0].per_example_grads(), ref)
