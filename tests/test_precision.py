"""Precision and device settings (issue #30 item 5): each changes what it says, its default is the documented one,
and every artifact records it.

* ``FitOptions.covariance_dtype`` / ``eigen_dtype`` / ``offload``: the curvature statistics' dtype, the
  eigendecompositions' dtype, CPU-resident sums (identical results on the CPU);
* ``Attributor(score_dtype=...)``: the dtype of the query x train products (``Scores.meta``);
* ``CaptureOptions.grad_dtype``: LoGra's projection products in float32 or in the activation dtype (bf16 models).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.fit.curvature import Curvature, fit_curvature
from gradtrace.fit.curvature.blocks import KronBlock, blocks_for
from gradtrace.fit.curvature.covariance import EigenCorrectionCallback
from gradtrace.options import CaptureOptions, FitOptions, Loss
from tests import tiny

EPS32 = torch.finfo(torch.float32).eps


def _ce(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _ill_conditioned(n: int = 2048, d: int = 6) -> tuple[nn.Module, list[dict], torch.Tensor]:
    """A linear classifier on inputs ``100 + small noise``: the activation factor's eigenvalues span ~15 decades."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Linear(d, 3)
    x = 100.0 + torch.randn(n, d, generator=gen) * 0.01 * torch.logspace(0, -1, d)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, [{"x": x[i:i + 256], "y": y[i:i + 256]} for i in range(0, n, 256)], x


def _lm_batches(n: int = 12, t: int = 10, batch: int = 4) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(1, tiny.VOCAB, (n, t), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + batch], "id": [f"e{j}" for j in range(i, i + batch)]} for i in range(0, n, batch)]


# -- defaults and checks ----------------------------------------------------------------------------------------
def test_defaults_are_the_documented_ones():
    fit = FitOptions()
    assert (fit.covariance_dtype, fit.eigen_dtype, fit.offload) == ("float32", "float64", False)
    assert CaptureOptions().grad_dtype == "float32"
    model = tiny.gpt2()
    train = gradtrace.collect(model, _lm_batches())
    assert gradtrace.Attributor("grad_dot", train).score_dtype == "float32"


def test_bad_values_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="covariance_dtype must be one of"):
        FitOptions(covariance_dtype="bfloat16")
    with pytest.raises(ValueError, match="eigen_dtype must be one of"):
        FitOptions(eigen_dtype="float16")
    with pytest.raises(ValueError, match="grad_dtype must be one of"):
        CaptureOptions(grad_dtype="bfloat16")
    model = tiny.gpt2()
    train = gradtrace.collect(model, _lm_batches())
    with pytest.raises(ValueError, match="score_dtype must be one of"):
        gradtrace.Attributor("grad_dot", train, score_dtype="float16")


# -- curvature ----------------------------------------------------------------------------------------------------
def _activation_eigenvalues(curvature: Curvature) -> torch.Tensor:
    eig = curvature.blocks["weight"]
    values = eig.cols_eig if eig.block.act_side == "cols" else eig.rows_eig
    return torch.sort(values.double()).values


@pytest.mark.parametrize(("covariance", "eigen", "accurate"), [("float64", "float64", True),
                                                              ("float32", "float64", False),
                                                              ("float64", "float32", False)])
def test_covariance_and_eigen_dtypes_are_the_dtypes_the_fit_uses(covariance, eigen, accurate):
    """The activation factor of inputs ``100 + noise`` has eigenvalues from 6e4 down to 6e-11: float64 sums and a
    float64 eigensolver find the small ones to the float32 rounding of the kept eigendata (measured: 5e-6 relative);
    float32 in either stage loses them (errors of ``eps32 * 6e4``, measured: 96-100% relative)."""
    model, data, x = _ill_conditioned()
    augmented = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    reference = torch.linalg.eigvalsh(augmented.t() @ augmented / len(x))
    curvature = fit_curvature(model, data, Loss(fn=_ce), fit_options=FitOptions(
        kind="kfac", covariance_dtype=covariance, eigen_dtype=eigen))
    small = ((_activation_eigenvalues(curvature) - reference).abs() / reference)[:3]
    if accurate:
        assert float(small.max()) < 1e-4, small
    else:
        assert float(small.max()) > 0.1, small
    assert all(t.dtype == torch.float32 for t in (curvature.blocks["weight"].q_cols, curvature.blocks["weight"].q_rows)
               if t is not None), "the eigendata is kept in float32 either way"


def test_ekfac_second_moments_accumulate_in_the_covariance_dtype():
    """The EK-FAC pass's sums ``sum_n (Q_R^T G_n Q_C)^2`` in float64 equal a float64 reference from the per-example
    gradients to 1e-12; in float32 to float32 round-off only."""
    model, data, _ = _ill_conditioned(n=512)
    with gradtrace.capture(model, Loss(reduction="sum")) as cap:
        for batch in data:
            _ce(model, batch).sum().backward()
    grads = cap.batches
    weight = grads[0].params["weight"]
    block = blocks_for(cap.handlers, {n: pg.shape for n, pg in grads[0].params.items()}, projected=False,
                       max_dense=4096)[0]
    assert isinstance(block, KronBlock) and weight.shape == (3, 6)
    gen = torch.Generator().manual_seed(1)
    q_rows = torch.linalg.qr(torch.randn(3, 3, generator=gen))[0]
    q_cols = torch.linalg.qr(torch.randn(7, 7, generator=gen))[0]
    sums = {}
    for dtype in (torch.float32, torch.float64):
        callback = EigenCorrectionCallback([block], {block.name: (q_rows, q_cols)}, dtype=dtype)
        for batch in grads:
            callback.on_batch(batch)
        sums[dtype] = callback.sums[block.name]
    reference = 0
    for batch in grads:
        full = torch.cat([batch.params["weight"].materialize(torch.float64),
                          batch.params["bias"].materialize(torch.float64).unsqueeze(-1)], dim=2)  # [E, 3, 7]
        reference = reference + (q_rows.double().t() @ full @ q_cols.double()).pow(2).sum(0)
    assert sums[torch.float64].dtype == torch.float64 and sums[torch.float32].dtype == torch.float32
    torch.testing.assert_close(sums[torch.float64], reference, rtol=1e-12, atol=0)
    error32 = float(((sums[torch.float32].double() - reference).abs() / reference.abs().max()).max())
    assert 0 < error32 < 1e-4


@pytest.mark.parametrize("kind", ["ekfac", "fisher"])
def test_offload_gives_identical_results_on_the_cpu(kind):
    model, data, _ = _ill_conditioned(n=512)
    fits = [fit_curvature(model, data, Loss(fn=_ce), fit_options=FitOptions(kind=kind, offload=offload))
            for offload in (False, True)]
    for name, eig in fits[0].blocks.items():
        other = fits[1].blocks[name]
        for key in ("q_rows", "q_cols", "q", "eigenvalues", "rows_eig", "cols_eig"):
            made, offloaded = getattr(eig, key, None), getattr(other, key, None)
            assert (made is None) == (offloaded is None) and (made is None or torch.equal(made, offloaded)), (name, key)
    assert fits[1].precision()["offload"] is True and fits[0].precision()["offload"] is False


def test_a_saved_curvature_records_its_precision_and_an_older_one_loads_with_defaults_assumed(tmp_path):
    model, data, _ = _ill_conditioned(n=512)
    options = FitOptions(kind="kfac", covariance_dtype="float64", eigen_dtype="float32", offload=True)
    fitted = fit_curvature(model, data, Loss(fn=_ce), fit_options=options)
    fitted.save(tmp_path / "new")
    recorded = json.loads((tmp_path / "new" / "curvature.json").read_text())["meta"]["gradtrace"]["options"]["fit"]
    assert (recorded["covariance_dtype"], recorded["eigen_dtype"], recorded["offload"]) == ("float64", "float32", True)
    loaded = Curvature.load(tmp_path / "new")
    assert loaded.precision() == {"covariance_dtype": "float64", "eigen_dtype": "float32", "offload": True,
                                  "assumed": []}
    assert "statistics in float64, eigendecompositions in float32, offloaded to the CPU" in loaded.report()
    # a fit saved before gradtrace recorded these settings: its meta has no such keys
    older = Curvature(fitted.kind, fitted.spec, fitted.blocks, fitted.fisher, fitted.damping, fitted.damping_mode,
                      {"examples": 512})
    older.save(tmp_path / "old")
    loaded = Curvature.load(tmp_path / "old")
    assert loaded.precision() == {"covariance_dtype": "float32", "eigen_dtype": "float64", "offload": False,
                                  "assumed": ["covariance_dtype", "eigen_dtype", "offload"]}
    assert "defaults assumed: covariance_dtype, eigen_dtype, offload" in loaded.report()


def test_method_settings_reach_the_fit():
    """An influence method's ``fit`` takes the precision settings with its other fit settings."""
    model = tiny.gpt2()
    batches = _lm_batches()
    train = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4)))
    attr = gradtrace.Attributor("ekfac", train, fisher="empirical")
    attr.fit(model, batches, covariance_dtype="float64", offload=True)
    assert attr.method.curvature.precision()["covariance_dtype"] == "float64"
    assert attr.method.curvature.precision()["offload"] is True


# -- scores -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["store", "memory"])
def test_score_dtype_is_the_precision_of_the_products(tmp_path, source):
    """float64 scores equal a float64 reference to 1e-12 relative; float32 ones differ from it, within the float32
    bound ``D * eps32 * |q| |t|`` of a D-term dot product (measured: about 1.5 eps32 of the largest score)."""
    model = tiny.gpt2()
    batches = _lm_batches(n=24)
    train = gradtrace.collect(model, batches[:4], store=tmp_path / "s" if source == "store" else None)
    queries = gradtrace.collect(model, batches[4:])
    query_rows, train_rows = queries.vectors.double(), train.read(0, len(train)).double()
    reference = query_rows @ train_rows.t()
    bound = train_rows.shape[1] * EPS32 * torch.outer(query_rows.norm(dim=1), train_rows.norm(dim=1))
    scores = {dtype: gradtrace.Attributor("grad_dot", train, score_dtype=dtype).score(queries, topk=3)
              for dtype in ("float32", "float64")}
    exact = scores["float64"]
    assert exact.matrix.dtype == torch.float64 and exact.top[0].dtype == torch.float64
    assert float(((exact.matrix - reference).abs() / reference.abs().max()).max()) <= 1e-12
    rounded = scores["float32"].matrix
    assert rounded.dtype == torch.float32
    error = (rounded.double() - reference).abs()
    assert float(error.max()) > 0 and bool((error <= bound).all())
    for dtype, result in scores.items():
        assert result.meta["gradtrace"]["options"]["score"]["score_dtype"] == dtype
    exact.save(tmp_path / "scores")
    loaded = gradtrace.Scores.load(tmp_path / "scores")
    assert torch.equal(loaded.matrix, exact.matrix)
    assert loaded.meta["gradtrace"]["options"]["score"]["score_dtype"] == "float64"


def test_float64_scores_through_a_curvature():
    """An influence method's prepared queries are scored in float64 too (the products, not the preconditioning)."""
    model = tiny.gpt2()
    batches = _lm_batches()
    logra = CaptureOptions(projection=gradtrace.LoGra(rank=4))
    train = gradtrace.collect(model, batches, options=logra)
    queries = gradtrace.collect(model, batches[:1], options=logra)
    attr = gradtrace.Attributor("kfac", train, fisher="empirical", score_dtype="float64")
    attr.fit(model, batches)
    prepared = attr.method.prepare_queries(queries.vectors).double()
    reference = prepared @ train.vectors.double().t()
    scores = attr.score(queries).matrix
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, reference, rtol=1e-12, atol=1e-12 * float(reference.abs().max()))


# -- per-sample gradients ---------------------------------------------------------------------------------------
def _bf16_llama() -> nn.Module:
    torch.manual_seed(0)
    return tiny.llama().to(torch.bfloat16)


def test_activation_grad_dtype_on_a_bf16_model_is_close_to_the_float32_path():
    """bf16 projection products: each projected value rounded once to bf16 (2^-9 relative), the per-example sums in
    float32. Rows within 1% of the float32 path (measured: 0.33%), cosine >= 0.999 (measured: 0.999995)."""
    model = _bf16_llama()
    batches = _lm_batches()
    logra = gradtrace.LoGra(rank=4)
    exact32 = gradtrace.collect(model, batches, options=CaptureOptions(projection=logra)).vectors
    low = gradtrace.collect(model, batches, options=CaptureOptions(projection=logra, grad_dtype="activation")).vectors
    assert low.dtype == exact32.dtype == torch.float32
    assert not torch.equal(low, exact32), "the products ran in bf16"
    cosine = F.cosine_similarity(low, exact32, dim=1)
    relative = (low - exact32).norm(dim=1) / exact32.norm(dim=1)
    assert float(cosine.min()) >= 0.999 and float(relative.max()) <= 1e-2, (cosine.min(), relative.max())


def test_activation_grad_dtype_on_a_float32_model_changes_nothing():
    model = tiny.llama()
    batches = _lm_batches()
    logra = gradtrace.LoGra(rank=4)
    same = [gradtrace.collect(model, batches, options=CaptureOptions(projection=logra, grad_dtype=dtype)).vectors
            for dtype in ("float32", "activation")]
    assert torch.equal(*same)


def test_activation_grad_dtype_needs_a_projection():
    model = tiny.gpt2()
    with pytest.raises(ValueError, match="grad_dtype='activation' sets the dtype of LoGra's projection products"):
        gradtrace.collect(model, _lm_batches(), options=CaptureOptions(grad_dtype="activation"))


def test_the_store_manifest_records_grad_dtype(tmp_path):
    model = _bf16_llama()
    options = CaptureOptions(projection=gradtrace.LoGra(rank=4), grad_dtype="activation")
    store = gradtrace.collect(model, _lm_batches(), store=tmp_path / "s", options=options)
    assert store.manifest["config"]["gradtrace"]["options"]["capture"]["grad_dtype"] == "activation"


def test_sharded_scoring_keeps_the_score_dtype(tmp_path):
    """Two gloo ranks (one of them without rows) score in float64 as one process does, and record it."""
    from gradtrace.options import StoreOptions
    from gradtrace.store import GradientSpec, ShardWriter
    from tests.distributed import jobs
    from tests.distributed.launch import run_ranks

    spec = GradientSpec(params=[("w", 6)], projection=None, convention={"reduction": "mean", "example_loss": "sum"},
                        model={"arch": "x"})
    gen = torch.Generator().manual_seed(0)
    for name, count, first in (("train", 7, 0), ("queries", 3, 100)):
        with ShardWriter(tmp_path / name, spec, StoreOptions(shard_rows=2)) as writer:
            writer.put([f"t{first + i}" for i in range(count)], torch.randn(count, 6, generator=gen))
    case = {"method": "grad_dot", "train": [str(tmp_path / "train")], "queries": [str(tmp_path / "queries")],
            "topk": 3, "matrix": True, "split": "writer", "method_options": {"score_dtype": "float64"}}
    per_rank = [r[0] for r in run_ranks(jobs.sharded_scores, [case], timeout=60)]
    train = gradtrace.GradientStore.open(tmp_path / "train")
    queries = gradtrace.GradientStore.open(tmp_path / "queries")
    want = gradtrace.Attributor("grad_dot", train, score_dtype="float64").score(queries, topk=3)
    for scores in per_rank:
        assert not isinstance(scores, str), scores
        assert scores.matrix.dtype == scores.top[0].dtype == torch.float64
        torch.testing.assert_close(scores.matrix, want.matrix, rtol=1e-12, atol=0)
        assert scores.meta["gradtrace"]["options"]["score"]["score_dtype"] == "float64"
        assert scores.meta["distributed"]["rows"] == [7, 0]


# -- on a GPU (skipped without one) --------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["ekfac", "fisher"])
def test_offload_on_a_gpu_keeps_the_sums_on_the_cpu_and_agrees(kind):
    """Batches on the GPU, sums on the CPU: the same fit as sums on the GPU up to the order of float32 additions."""
    model, data, _ = _ill_conditioned(n=512)
    run = gradtrace.RunOptions(device="cuda")
    fits = [fit_curvature(model.cuda(), data, Loss(fn=_ce), fit_options=FitOptions(kind=kind, offload=offload),
                          run=run) for offload in (False, True)]
    for name, eig in fits[0].blocks.items():
        torch.testing.assert_close(fits[1].blocks[name].eigenvalues.cpu(), eig.eigenvalues.cpu(), rtol=1e-4,
                                   atol=1e-6 * float(eig.eigenvalues.abs().max()))
    assert all(e.eigenvalues.device.type == "cpu" for e in fits[1].blocks.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_scores_and_bf16_projection_on_a_gpu():
    model = tiny.gpt2()
    batches = _lm_batches(n=24)
    train, queries = gradtrace.collect(model, batches[:4]), gradtrace.collect(model, batches[4:])
    reference = queries.vectors.double() @ train.vectors.double().t()
    scores = gradtrace.Attributor("grad_dot", train, device="cuda", score_dtype="float64").score(queries, topk=3)
    assert float(((scores.matrix - reference).abs() / reference.abs().max()).max()) <= 1e-12
    bf16 = _bf16_llama().cuda()
    logra = gradtrace.LoGra(rank=4)
    run = gradtrace.RunOptions(device="cuda")
    rows = [gradtrace.collect(bf16, _lm_batches(), options=CaptureOptions(projection=logra, grad_dtype=dtype),
                              run=run).vectors for dtype in ("float32", "activation")]
    assert float(F.cosine_similarity(rows[0], rows[1], dim=1).min()) >= 0.999
