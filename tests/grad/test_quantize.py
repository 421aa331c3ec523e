"""Row quantization round trips, its effect on score rankings, and the Spearman helper."""

import itertools

import pytest
import torch

from gradtrace.grad.quantize import QuantizedRows, quantize, spearman
from gradtrace.options import CaptureOptions


def _gradient_like(count, dim, gen):
    """Rows like projected gradients: Gaussian directions with log-normally spread norms."""
    return torch.randn(count, dim, generator=gen) * torch.exp(1.5 * torch.randn(count, 1, generator=gen))


def test_int8_error_is_within_half_a_step_per_row():
    gen = torch.Generator().manual_seed(0)
    rows = _gradient_like(300, 257, gen)
    rows[3] = 0.0  # an all-zero row
    rows[4, 10] = -50.0  # a row dominated by one entry
    packed = quantize(rows, "int8")
    assert packed.data.dtype == torch.int8 and packed.scale.dtype == torch.float32
    assert packed.scale.shape == (300,) and packed.mode == "int8"
    assert int(packed.data.abs().max()) == 127
    back = packed.dequantize()
    assert back.dtype == torch.float32 and back.shape == rows.shape
    row_max = rows.abs().amax(dim=1)
    err = (back - rows).abs().amax(dim=1)
    assert torch.all(err <= row_max / 254 * (1 + 1e-5) + 1e-12)
    assert packed.scale[3] == 0 and torch.equal(back[3], torch.zeros(257))
    assert packed.nbytes == 300 * 257 + 300 * 4


def test_float_modes_round_trip():
    gen = torch.Generator().manual_seed(1)
    rows = _gradient_like(50, 64, gen)
    exact = quantize(rows, "fp32")
    assert exact.scale is None and torch.equal(exact.dequantize(), rows) and exact.nbytes == 50 * 64 * 4
    half = quantize(rows, "bf16")
    assert half.data.dtype == torch.bfloat16 and half.nbytes == 50 * 64 * 2
    back = half.dequantize()
    assert back.dtype == torch.float32
    assert torch.all((back - rows).abs() <= rows.abs() * 2.0**-8)  # round to nearest, 8 significant bits
    assert torch.equal(back, rows.to(torch.bfloat16).to(torch.float32))
    assert torch.equal(quantize(rows.to(torch.bfloat16), "bf16").data, rows.to(torch.bfloat16))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="mode"):
        quantize(torch.ones(2, 2), "int4")
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([[1.0, float("inf")]]), "int8")
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([[1.0, float("nan")]]), "int8")
    with pytest.raises(ValueError):
        quantize(torch.ones(3), "int8")
    with pytest.raises(ValueError):
        QuantizedRows(torch.ones(2, 2, dtype=torch.int8), None, "int8")
    empty = quantize(torch.zeros(4, 0), "int8")
    assert empty.dequantize().shape == (4, 0)


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_quantized_train_rows_keep_score_rankings(mode):
    gen = torch.Generator().manual_seed(2)
    train, queries = _gradient_like(2000, 1024, gen), _gradient_like(16, 1024, gen)
    exact = queries @ train.t()  # [16, 2000]
    approx = queries @ quantize(train, mode).dequantize().t()
    rho = spearman(exact, approx)
    assert rho.shape == (16,)
    assert rho.min().item() >= 0.99


def _brute_spearman(a, b):
    def ranks(values):
        return [sum(1.0 for w in values if w < v) + (sum(1.0 for w in values if w == v) - 1) / 2 for v in values]

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def test_spearman_matches_brute_force_with_ties():
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, 5, (6, 30), generator=gen).float()  # many ties
    b = a + torch.randint(-2, 3, (6, 30), generator=gen).float()
    b[0] = torch.randn(30, generator=gen)  # no ties on one side
    got = spearman(a, b)
    want = torch.tensor([_brute_spearman(x.tolist(), y.tolist()) for x, y in zip(a, b)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(spearman(a[1], b[1]), want[1])  # 1-D inputs give a 0-d result
    # Exhaustive check on every ordering of a small row with a tie.
    base = [0.0, 1.0, 1.0, 2.0, 3.0]
    perms = torch.tensor(list(itertools.permutations(base)))
    ref = torch.tensor(base).expand_as(perms)
    want = torch.tensor([_brute_spearman(base, p.tolist()) for p in perms], dtype=torch.float64)
    torch.testing.assert_close(spearman(ref, perms), want, rtol=1e-12, atol=1e-12)


def test_spearman_invariances_and_edge_cases():
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 100, generator=gen), torch.randn(4, 100, generator=gen)
    rho = spearman(a, b)
    torch.testing.assert_close(spearman(a.exp(), b * 3 + 1), rho)  # monotone maps do not change ranks
    torch.testing.assert_close(spearman(a, a), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(spearman(a, -a), -torch.ones(4, dtype=torch.float64))
    assert torch.isnan(spearman(torch.ones(1, 5), torch.randn(1, 5))).all()
    with pytest.raises(ValueError):
        spearman(a, b[:, :50])


def test_int8_store_keeps_score_ranking_on_captured_gradients():
    """Real LoGra gradients of a tiny GPT-2: int8 rows rank training examples like float32."""
    import gradtrace
    from tests import tiny

    torch.manual_seed(0)
    model = tiny.gpt2()
    ids = torch.randint(1, tiny.VOCAB, (48, 12))
    logra = gradtrace.LoGra(rank=8)
    train = gradtrace.collect(model, [{"input_ids": ids[i:i + 16]} for i in range(0, 40, 16)],
                              options=CaptureOptions(projection=logra))
    queries = gradtrace.collect(model, [{"input_ids": ids[40:]}], options=CaptureOptions(projection=logra))
    base = queries.vectors @ train.vectors.t()
    approx = queries.vectors @ quantize(train.vectors, "int8").dequantize().t()
    assert float(spearman(base, approx).min()) >= 0.99
