"""Operations on GradientBatch: every route gives the same numbers as the materialized brute force."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.grad import ops
from gradtrace.grad.cost import CostModel, MachineProfile, TermShape
from gradtrace.grad.ghost import ghost_inner
from gradtrace.grad.terms import OuterTerm
from gradtrace.options import CaptureOptions
from tests import tiny
from tests.capture.test_exact import _lm_batch


def _two_batches(model, projection=None):
    _, ids, mask, labels, pos = _lm_batch([5, 8, 3, 7])
    with gradtrace.capture(model, options=CaptureOptions(projection=projection)) as cap:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
        model(input_ids=ids[1:3], attention_mask=mask[1:3], position_ids=pos[1:3], labels=labels[1:3]).loss.backward()
    return cap.batches


@pytest.fixture(scope="module")
def gpt2_batches():
    torch.manual_seed(0)
    return _two_batches(tiny.gpt2(tied=True))


def _close(got, want):
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), (got - want).abs().max()


@pytest.mark.parametrize("route", ["auto", "ghost", "materialize"])
@pytest.mark.parametrize("max_bytes", [64 * 2**20, 4096])
def test_inner_products_all_routes_equal_brute_force(gpt2_batches, route, max_bytes):
    a, b = gpt2_batches
    want = a.flat() @ b.flat().t()
    _close(ops.inner(a, b, route=route, max_bytes=max_bytes), want)
    per = ops.inner(a, b, route=route, per_param=True, max_bytes=max_bytes)
    for name, value in per.items():
        _close(value, a.params[name].flat() @ b.params[name].flat().t())


@pytest.mark.parametrize("route", ["auto", "ghost", "materialize"])
def test_sq_norms_all_routes(gpt2_batches, route):
    a, _ = gpt2_batches
    _close(ops.sq_norms(a, route=route, max_bytes=8192), a.flat().pow(2).sum(1))


def test_token_decomposition_sums_to_scores(gpt2_batches):
    a, b = gpt2_batches
    tokens = ops.token_inner(a, b, max_bytes=16384)
    assert tokens.shape == (len(a), a.num_tokens, len(b))
    _close(tokens.sum(1), a.flat() @ b.flat().t())
    # against a reduced (materialized) second side the same decomposition holds
    _close(ops.token_inner(a, b.reduced()), tokens)


def test_token_decomposition_brute_force_linear():
    """Token t's share is <s_t a_t^T, H_j>: check against explicit per-token outer products."""
    r, c = torch.randn(3, 5, 4), torch.randn(3, 5, 6)
    term = OuterTerm(r, c, 4, 6)
    other = OuterTerm(torch.randn(2, 7, 4), torch.randn(2, 7, 6), 4, 6)
    per_token = ghost_inner(term, other, per_token=True, max_bytes=512)
    explicit = torch.einsum("etr,etc,frc->etf", r, c, other.materialize())
    _close(per_token, explicit)


def test_ghost_with_index_factors_matches_materialized():
    ids_a = torch.tensor([[3, 1, -1, 3], [0, 2, 2, 4]])
    ids_b = torch.tensor([[1, 1, 4], [-1, 0, 3], [2, 2, 2]])
    a = OuterTerm(ids_a, torch.randn(2, 4, 5), 6, 5)
    b = OuterTerm(ids_b, torch.randn(3, 3, 5), 6, 5)
    dense_b = OuterTerm(torch.randn(3, 3, 6), torch.randn(3, 3, 5), 6, 5)
    for other in (b, dense_b):
        want = a.materialize().reshape(2, -1) @ other.materialize().reshape(3, -1).t()
        _close(ghost_inner(a, other, max_bytes=100), want)
        _close(ghost_inner(other, a, max_bytes=100), want.t())


def test_logra_batches_and_conv(gpt2_batches):
    torch.manual_seed(1)
    a, b = _two_batches(tiny.llama(), gradtrace.LoGra(rank=4, keep_tokens=True))
    for route in ("ghost", "materialize"):
        _close(ops.inner(a, b, route=route), a.flat() @ b.flat().t())
    model = tiny.ConvNet()
    with gradtrace.capture(model) as cap:
        F.cross_entropy(model(torch.randn(5, 2, 8, 8)), torch.randint(0, 3, (5,))).backward()
    batch = cap.batches[0]
    for route in ("ghost", "materialize"):
        _close(ops.inner(batch, batch, route=route), batch.flat() @ batch.flat().t())
        _close(ops.sq_norms(batch, route=route), batch.flat().pow(2).sum(1))


def test_concat_select_to(gpt2_batches):
    a, b = gpt2_batches
    both = ops.concat([a, b])
    assert len(both) == len(a) + len(b) and both.ids == a.ids + b.ids
    _close(both.flat(), torch.cat([a.flat(), b.flat()]))
    part = both.select([5, 0])
    _close(part.flat(), both.flat()[[5, 0]])
    half = a.to(dtype=torch.bfloat16)
    assert half.params["transformer.h.0.attn.c_attn.weight"].terms[0].rows.dtype == torch.bfloat16
    assert torch.allclose(half.flat(), a.flat(), rtol=2e-2, atol=1e-2 * float(a.flat().abs().max()))


def test_mismatches_are_clear_errors(gpt2_batches):
    a, b = gpt2_batches
    with pytest.raises(ops.IncompatibleGradients, match="different parameters"):
        ops.inner(a, b.select([0])._with_params(dict(list(b.params.items())[:-1])))
    with pytest.raises(ops.IncompatibleGradients, match="cast one side"):
        ops.inner(a, b.to(dtype=torch.bfloat16))
    projected = _two_batches(tiny.gpt2(tied=True), gradtrace.LoGra(rank=2))[0]
    with pytest.raises(ops.IncompatibleGradients, match="projection"):
        ops.inner(a, projected)


def test_nonfinite_examples_are_reported(gpt2_batches):
    a, _ = gpt2_batches
    bad = a.select([0, 1, 2, 3])
    bad.nonfinite = torch.tensor([False, True, False, False])
    with pytest.warns(UserWarning, match="NaN/inf"):
        ops.sq_norms(bad)


def test_cost_model_prefers_obvious_routes():
    profile = MachineProfile(flops_per_s=5e10, bytes_per_s=1e10, call_overhead_s=1e-5)
    model = CostModel(profile)
    short_wide = TermShape(64, 2, 4096, 4096)
    long_narrow = TermShape(64, 2048, 64, 64)
    assert model.choose_inner(short_wide, short_wide) == "ghost"
    assert model.choose_inner(long_narrow, long_narrow) == "materialize"
    embedding = TermShape(64, 128, 50257, 512, index_rows=True)
    assert model.choose_inner(embedding, embedding) == "ghost"
    sizes = model.storage_bytes(short_wide, projected_dim=256)
    assert sizes["factorized"] < sizes["materialized"]
    assert model.choose_storage(short_wide, projected_dim=256) == "projected"


def test_weighted_sum_and_dense_inner_equal_materialized(gpt2_batches):
    a, _ = gpt2_batches
    weights = torch.rand(len(a))
    sparse = weights * (torch.arange(len(a)) % 2 == 0)  # zero weights skip their examples
    vectors = {}
    for name, pg in a.params.items():
        full = pg.materialize()
        for w in (weights, sparse, torch.zeros(len(a))):
            want = (full * w.view(-1, *[1] * (full.dim() - 1))).sum(0)
            got = ops.weighted_sum(pg, w)
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max() + 1)), name
        vectors[name] = torch.randn(pg.shape)
    want = sum(a.params[n].flat() @ v.reshape(-1) for n, v in vectors.items())
    _close(ops.dense_inner(a, vectors), want)


def test_calibrating_the_cost_model_leaves_the_global_random_stream_alone():
    from gradtrace.grad.cost import MachineProfile

    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    MachineProfile.calibrate(seconds=0.001)
    assert torch.equal(torch.rand(3), want)
