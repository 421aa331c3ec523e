"""Vector parameters (biases, norm weights) under LoGra: each row's tokens are summed before the projection when
that is exact (tokens not kept, rows not packed) -- the same per-example gradient as projecting every token, with
padding's NaN/inf still kept out of the examples (issue #17: fewer, smaller projection products at capture)."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.grad.terms import VectorTerm
from gradtrace.options import CaptureOptions, Loss
from gradtrace.projection.logra import Projector
from tests import tiny
from tests.reliability.test_no_silent_loss import (
    LENGTHS,
    NAMES,
    _padded_batch,
    _single_loss,
    collect_with_nan_in_padding,
)

RANK = 4


def _captured(model, data, monkeypatch, **logra):
    """The captured batch and the shapes of what each vector projection received."""
    shapes: list[tuple[int, ...]] = []
    project = Projector.project

    def spy(self, param, axis, x):
        if axis == "vector":
            shapes.append(tuple(x.shape))
        return project(self, param, axis, x)

    monkeypatch.setattr(Projector, "project", spy)
    with gradtrace.capture(model, loss=Loss(reduction="sum", example_loss="sum"),
                           options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK, **logra))) as cap:
        cap.annotate(ids=NAMES)
        loss = gradtrace.loss.functions.causal_lm_loss(model, data).sum()
        loss.backward()
    model.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return cap.batches[0], shapes


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_summed_then_projected_equals_projected_per_token(arch, monkeypatch):
    torch.manual_seed(0)
    model = getattr(tiny, arch)()
    data = _padded_batch()
    (summed, sum_shapes), (per_token, token_shapes) = (_captured(model, data, monkeypatch),
                                                       _captured(model, data, monkeypatch, keep_tokens=True))
    rows = len(LENGTHS)
    assert sum_shapes and all(len(s) == 2 and s[0] == rows for s in sum_shapes)  # [B, n]: summed first
    assert token_shapes and all(s[:2] == (rows, max(LENGTHS)) for s in token_shapes)  # [B, T, n]
    vectors = [name for name, grad in per_token.params.items() if isinstance(grad.terms[0], VectorTerm)]
    assert len(vectors) == len(sum_shapes)
    for name in vectors:
        got = summed.params[name].flat()
        want = per_token.params[name].reduced().flat()
        # float32 sums of T = 10 tokens in two orders, then a k x n product: a few eps of the largest magnitude
        bound = 64 * torch.finfo(torch.float32).eps * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=bound)


def test_nan_in_padding_stays_out_of_projected_vectors():
    """A NaN at a padded position makes its row's token sum NaN: that row takes the per-token path, whose padding
    the assembly cleans; the projected gradients equal the LoGra projection of brute-force per-example ones."""
    torch.manual_seed(0)
    model = tiny.gpt2()
    data = _padded_batch()
    grads = collect_with_nan_in_padding(model, data,
                                        options=gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=RANK)))
    ref = tiny.reference_grads(model, [data["input_ids"][i, :n] for i, n in enumerate(LENGTHS)], _single_loss)
    projector = Projector(gradtrace.LoGra(rank=RANK))
    assert grads.dropped == [] and grads.ids == NAMES
    start = 0
    for name, dim in grads.spec.params:
        got = grads.vectors[:, start:start + dim]
        start += dim
        want = projector.project_full(name, ref[name], tuple(ref[name].shape[1:]))
        bound = 1e-4 * float(want.abs().max()) + 1e-6
        torch.testing.assert_close(got, want, rtol=0, atol=bound)
