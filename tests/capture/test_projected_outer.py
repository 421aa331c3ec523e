"""Matrix parameters under LoGra: each row's tokens are summed in the backward hook when that is exact (tokens not
kept, rows not packed), so a site holds ``[B, k, k]`` instead of ``T`` tokens of both projected factors until the
backward pass ends -- the same per-example gradient as the per-token factors summed at assembly."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.capture import collector
from gradtrace.grad.terms import OuterTerm
from gradtrace.options import CaptureOptions, Loss
from tests import tiny
from tests.reliability.test_no_silent_loss import LENGTHS, NAMES, _padded_batch

RANK = 4


def _site_terms_and_batch(model, data, monkeypatch, **logra):
    """Every matrix term a handler returned (held until the backward pass ends) and the captured batch."""
    held: list[OuterTerm] = []
    real = collector.SiteResult

    def spy(context, order, terms):
        held.extend(t for t in terms.values() if isinstance(t, OuterTerm))
        return real(context, order, terms)

    monkeypatch.setattr(collector, "SiteResult", spy)
    with gradtrace.capture(model, loss=Loss(reduction="sum", example_loss="sum"),
                           options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK, **logra))) as cap:
        cap.annotate(ids=NAMES)
        gradtrace.loss.functions.causal_lm_loss(model, data).sum().backward()
    model.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return held, cap.batches[0]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_summed_in_the_hook_equals_per_token_factors(arch, monkeypatch):
    torch.manual_seed(0)
    model = getattr(tiny, arch)()
    data = _padded_batch()
    summed_terms, summed = _site_terms_and_batch(model, data, monkeypatch)
    token_terms, per_token = _site_terms_and_batch(model, data, monkeypatch, keep_tokens=True)
    # every site holds [B, k, k] (k pseudo-tokens), not [B, T, k] twice
    assert summed_terms and all(t.num_tokens == RANK and t.num_examples == len(LENGTHS) for t in summed_terms)
    assert token_terms and all(t.num_tokens == max(LENGTHS) for t in token_terms)
    for name, grad in per_token.params.items():
        got = summed.params[name].flat()
        want = grad.reduced().flat()
        bound = 64 * torch.finfo(torch.float32).eps * float(want.abs().max()) * max(LENGTHS)
        torch.testing.assert_close(got, want, rtol=0, atol=bound, msg=name)
