"""bf16 models: factors stay in bf16, products and sums are accumulated in fp32.

Stated tolerance: the captured per-example gradient of every parameter is within 3% (relative
Frobenius error) of the brute-force per-example loop run on the same bf16 model, and within 3% of the
float32 gradient of the same weights. bf16 keeps 8 significant bits (~0.4% per rounding), and a forward
and backward pass compound a few dozen roundings.
"""

import pytest
import torch

import gradtrace
from gradtrace.options import CaptureOptions
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss

TOL = 3e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("make", [tiny.gpt2, tiny.llama], ids=["gpt2", "llama"])
def test_bf16_capture_within_tolerance(make):
    model32 = make()
    model16 = make()
    model16.load_state_dict(model32.state_dict())
    model16 = model16.to(torch.bfloat16)
    rows, ids, mask, labels, pos = _lm_batch([6, 9, 4])
    ref16 = tiny.reference_grads(model16, rows, _lm_single_loss)
    ref32 = tiny.reference_grads(model32, rows, _lm_single_loss)
    with gradtrace.capture(model16, options=CaptureOptions(verify=True)) as cap:
        out = model16(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    got = cap.batches[0].per_example_grads()
    for name in ref16:
        assert got[name].dtype == torch.float32
        for e in range(len(rows)):
            if ref32[name][e].norm() < 1e-3 * ref32[name].norm():
                continue  # (near-)zero gradients, e.g. embedding rows of absent tokens
            assert _rel(got[name][e], ref16[name][e]) < TOL, (name, e)
            assert _rel(got[name][e], ref32[name][e]) < TOL, (name, e)
