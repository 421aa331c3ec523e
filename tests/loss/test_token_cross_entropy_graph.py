"""token_cross_entropy's backward builds a graph when asked (create_graph: metagradients differentiate a gradient):
its second derivatives equal F.cross_entropy's, and its first-order gradient is unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradtrace.loss import token_cross_entropy


def test_double_backward_equals_cross_entropys():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, -100, 0, 10, 5, -100])
    probe = torch.randn(6, 11, generator=gen, dtype=torch.float64)
    weights = torch.rand(6, generator=gen, dtype=torch.float64)

    def second(fn):
        losses = fn(logits, targets)
        (grad,) = torch.autograd.grad((losses * weights).sum(), logits, create_graph=True)
        (hvp,) = torch.autograd.grad((grad * probe).sum(), logits)
        return grad.detach(), hvp

    reference = second(lambda x, t: F.cross_entropy(x, t, ignore_index=-100, reduction="none"))
    got = second(token_cross_entropy)
    # token_cross_entropy's losses are float32 for every logits dtype (by design), so the gradient reaching them is
    # rounded to float32 (relative 6e-8) before the float64 softmax: float32 round-off bounds the difference
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7 * float(r.abs().max()))
    assert float(reference[1].abs().max()) > 0


def test_first_order_path_is_unchanged():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=gen, requires_grad=True)
    targets = torch.tensor([1, 2, -100, 6, 0])
    token_cross_entropy(logits, targets).sum().backward()
    want = torch.softmax(logits.detach(), 1) - F.one_hot(targets.clamp(min=0), 7)
    want[targets == -100] = 0
    torch.testing.assert_close(logits.grad, want, rtol=1e-6, atol=1e-6)
