"""Non-reentrant activation checkpointing under capture: the per-example gradients are those of the plain step
and of one backward pass per example, and the capture keeps no layer input of the first forward until backward
(``gradtrace/capture/saved.py``; peak memory: ``bench/checkpoint_memory.py``)."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradtrace
from gradtrace.options import CaptureOptions, Loss
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss

LOGRA = gradtrace.LoGra(rank=3, vector_rank=2)


class Block(nn.Module):
    """A residual block ending in a captured linear layer: its output-gradient arrives before any node of the
    checkpointed region unpacks a saved tensor, so the capture's own unpack starts the re-run forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.rms = nn.RMSNorm(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(self.rms(torch.tanh(self.up(self.norm(x)))))


class Checkpointed(nn.Module):
    """Token inputs ``[B, T, d]`` through three blocks, each under ``torch.utils.checkpoint`` when ``ckpt``."""

    def __init__(self, width: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, classes)
        self.ckpt, self.early_stop = False, True

    def forward(self, x):
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False, early_stop=self.early_stop) if self.ckpt else block(x))
        return self.head(x).sum(1)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def _captured(model, x, y, projection, **kw):
    with gradtrace.capture(model, Loss(reduction="sum"), options=CaptureOptions(projection=projection, **kw)) as cap:
        _loss(model, x, y).backward()
    (batch,) = cap.batches
    return batch.per_example_grads() if projection is None else {"flat": batch.flat()}


def _close(got, want, tol=1e-5):
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=tol, atol=tol * float(want[n].abs().max())), n


@pytest.mark.parametrize("projection", [None, LOGRA], ids=["exact", "logra"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpointed_blocks_match_the_plain_step_and_brute_force(projection, early_stop):
    torch.manual_seed(0)
    model = Checkpointed()
    x, y = torch.randn(4, 3, 6), torch.randint(0, 5, (4,))
    plain = _captured(model, x, y, projection, verify=True)
    model.ckpt, model.early_stop = True, early_stop
    got = _captured(model, x, y, projection, verify=True)
    assert got.keys() == plain.keys()
    _close(got, plain)
    if projection is None:
        ref = tiny.reference_grads(model, list(zip(x, y)), lambda m, e: _loss(m, e[0][None], e[1].view(1)))
        tiny.assert_grads_close(got, ref)


@pytest.mark.parametrize("make", [tiny.gpt2, tiny.llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("projection", [None, LOGRA], ids=["exact", "logra"])
def test_hf_gradient_checkpointing_matches_the_plain_step(make, projection):
    model = make()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 4])

    def captured():
        model.train()
        with gradtrace.capture(model, options=CaptureOptions(projection=projection, verify=True)) as cap:
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
            tiny.lm_example_loss(out.logits, labels).mean().backward()
        (batch,) = cap.batches
        return batch.per_example_grads() if projection is None else {"flat": batch.flat()}

    plain = captured()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = captured()
    _close(got, plain)
    if projection is None:
        tiny.assert_grads_close(got, tiny.reference_grads(model, rows, _lm_single_loss))


def _storage_refs(ckpt, capture, projection=None):
    """References to the storage of each captured layer input inside the (checkpointed) blocks once the forward
    pass is over, before backward (the head's input, outside checkpointing, is autograd's and the capture's)."""
    torch.manual_seed(0)
    model, inputs = Checkpointed(), []
    for module in model.blocks.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.RMSNorm)):
            module.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    model.ckpt = ckpt
    x, y = torch.randn(4, 3, 6, requires_grad=True), torch.randint(0, 5, (4,))
    with gradtrace.capture(model, Loss(reduction="sum"), options=CaptureOptions(projection=projection)) if capture \
            else nullcontext() as cap:
        loss = _loss(model, x, y)
        counts = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in inputs]
        loss.backward()
    assert not capture or len(cap.batches) == 1
    return counts


@pytest.mark.parametrize("projection", [None, LOGRA], ids=["exact", "logra"])
def test_capture_holds_no_input_of_the_first_forward(projection):
    """Every layer input is referenced as often after a checkpointed forward under capture as without capture;
    without checkpointing the capture does hold them (a view of what autograd saves), which the count sees."""
    assert _storage_refs(True, True, projection) == _storage_refs(True, False)
    if projection is None:
        assert _storage_refs(False, True) != _storage_refs(False, False)


def test_two_forwards_before_one_checkpointed_backward():
    torch.manual_seed(0)
    model = Checkpointed()
    model.ckpt = True
    x, y = torch.randn(5, 3, 6), torch.randint(0, 5, (5,))
    ref = tiny.reference_grads(model, list(zip(x, y)), lambda m, e: _loss(m, e[0][None], e[1].view(1)))
    with gradtrace.capture(model, Loss(reduction="sum")) as cap:
        (_loss(model, x[:2], y[:2]) + _loss(model, x[2:], y[2:])).backward()
    tiny.assert_grads_close(cap.batches[0].per_example_grads(), ref)


def test_save_on_cpu_and_retained_graph():
    """Other saved-tensor hooks pack the capture's tensors too; a retained checkpointed graph backpropagated twice
    re-runs the forward each time and gives the same batch twice."""
    torch.manual_seed(0)
    model = Checkpointed()
    x, y = torch.randn(4, 3, 6), torch.randint(0, 5, (4,))
    plain = _captured(model, x, y, None)
    with gradtrace.capture(model, Loss(reduction="sum")) as cap:
        with torch.autograd.graph.save_on_cpu():
            loss = _loss(model, x, y)
        loss.backward()
    _close(cap.batches[0].per_example_grads(), plain)
    model.ckpt = True
    with gradtrace.capture(model, Loss(reduction="sum")) as cap:
        loss = _loss(model, x, y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert len(cap.batches) == 2
    for batch in cap.batches:
        _close(batch.per_example_grads(), plain)


def test_a_torch_without_the_saved_tensor_hooks_query_says_what_it_costs(monkeypatch):
    """Without torch's (private) query of the saved-tensor hooks in force the capture keeps its layers' inputs as
    they are: still exact, but it says that checkpointing no longer saves their memory."""
    from gradtrace.capture import saved

    monkeypatch.setattr(saved, "_top_hooks", None)
    x = torch.randn(2, 3)
    with pytest.warns(RuntimeWarning, match="under non-reentrant activation checkpointing they stay alive"):
        kept = saved.Kept(x)
    assert kept.get() is x
