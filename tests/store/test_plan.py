"""``gradtrace.plan``: the numbers of a collection before it runs, checked against the store it then writes."""

import pytest
import torch

import gradtrace
from gradtrace.fit import EKFAC, TRAK, TrackStar
from gradtrace.options import CaptureOptions, FitOptions, StoreOptions
from gradtrace.plan import RECORD_BYTES_PER_ROW
from gradtrace.plan.resources import free_space
from tests import tiny


def _lm_batches(n: int = 10, batch: int = 4, length: int = 6):
    tokens = torch.randint(0, tiny.VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, 4:] = 0  # a padded example: its padding is not counted
    return [{"input_ids": tokens[s:s + batch], "attention_mask": mask[s:s + batch], "labels": tokens[s:s + batch]}
            for s in range(0, n, batch)]


def test_plan_matches_the_store_collect_writes(tmp_path):
    torch.manual_seed(0)
    model = tiny.gpt2()
    data, logra = _lm_batches(), gradtrace.LoGra(rank=2)
    got = gradtrace.plan(model, data, store=tmp_path / "s", options=CaptureOptions(projection=logra),
                         store_options=StoreOptions(dtype="int8"))
    store = gradtrace.collect(model, data, store=tmp_path / "s", options=CaptureOptions(projection=logra),
                              store_options=StoreOptions(dtype="int8"))
    assert got.examples == len(store) == 10 and got.tokens == 10 * 6 - 2
    assert got.dim == store.dim and got.params == len(store.spec.params)
    assert got.bytes_per_example == store.dim + 4  # int8 values and a float32 scale
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "s" / "shards").glob("*.data")) + \
        sum(f.stat().st_size for f in (tmp_path / "s" / "shards").glob("*.scale"))
    assert data_bytes == 10 * got.bytes_per_example
    assert got.store_bytes == 10 * (got.bytes_per_example + RECORD_BYTES_PER_ROW)
    assert got.free_bytes > got.store_bytes and got.fits and got.seconds > 0


def test_plan_refuses_a_one_shot_generator():
    with pytest.raises(ValueError, match="iterates data twice"):
        gradtrace.plan(tiny.MLP(), (b for b in [(torch.randn(2, 7), torch.tensor([0, 1]))]))


def test_free_space_of_a_path_not_created_yet(tmp_path):
    assert free_space(tmp_path / "a" / "b") == free_space(tmp_path) > 0


def _mlp_data(n: int = 12, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 7, generator=g), torch.randint(0, 4, (n,), generator=g)
    return [(x[s:s + batch], y[s:s + batch]) for s in range(0, n, batch)]


def _saved_floats(directory) -> int:
    """Float32 values in a saved artifact's safetensors file."""
    from safetensors import safe_open

    (path,) = directory.glob("*.safetensors")
    with safe_open(str(path), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return sum(f.get_tensor(k).numel() for k in names)


@pytest.mark.parametrize("kind, passes", [("kfac", 1), ("ekfac", 2)])
def test_plan_fit_sizes_by_hand(tmp_path, kind, passes):
    # tests/tiny.MLP, exact gradients: Linear 7->12, LayerNorm 12, Linear 12->12, RMSNorm 12, Linear 12->4.
    # Kronecker blocks (bias joined as an activation column): [12, 8], [12, 13], [4, 13]; dense: LN weight, LN bias,
    # RMSNorm weight (12 each). Factors d_out^2 + d_in^2 per Kronecker block, dim^2 per dense block:
    factors = (144 + 64) + (144 + 169) + (16 + 169) + 3 * 144
    # saved: both eigenbases, the eigenvalue grid and both sides' eigenvalues; dense: eigenbasis and eigenvalues
    saved = (144 + 64 + 96 + 12 + 8) + (144 + 169 + 156 + 12 + 13) + (16 + 169 + 52 + 4 + 13) + 3 * (144 + 12)
    torch.manual_seed(0)
    model, data = tiny.MLP(), _mlp_data()
    store = gradtrace.collect(model, data, store=tmp_path / "s")
    got = gradtrace.plan_fit(store, model, data, method=kind, options=FitOptions(fisher="empirical"),
                             out=tmp_path / "c")
    assert (got.examples, got.tokens, got.passes, got.blocks, got.kron_blocks) == (12, None, passes, 6, 3)
    assert got.factor_floats == factors and got.curvature_bytes == 4 * saved
    assert got.free_bytes > 0 and got.fits  # free_space(out): other writers change it between two calls
    assert got.seconds_per_example > 0 and got.seconds == pytest.approx(12 * got.seconds_per_example +
                                                                       got.fixed_seconds)
    fitted = gradtrace.Attributor(kind, store, fisher="empirical").fit(model, data).method.curvature
    fitted.save(tmp_path / "c")
    assert _saved_floats(tmp_path / "c") == saved  # the plan's size is what the fit saves


def test_plan_fit_logra_from_the_store(tmp_path):
    torch.manual_seed(0)
    model = tiny.gpt2()
    store = gradtrace.collect(model, _lm_batches(), store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    dims = [d for _, d in store.spec.params]
    assert max(dims) <= 4096  # every block dense: d^2 factor values, d^2 + d saved
    got = gradtrace.plan_fit(store, method="logra", out=tmp_path / "c")
    assert (got.examples, got.passes, got.blocks, got.kron_blocks) == (10, 1, len(dims), 0)
    assert got.factor_floats == sum(d * d for d in dims) and got.curvature_bytes == 4 * sum(d * d + d for d in dims)
    attr = gradtrace.Attributor("logra", store).fit()
    attr.method.curvature.save(tmp_path / "c")
    assert _saved_floats(tmp_path / "c") == got.curvature_bytes // 4


@pytest.mark.parametrize("method, precondition", [("trak", "primal"), ("trak", "dual"), ("trackstar", None),
                                                  ("trackstar", "autocorrelation"), ("trackstar", "parameter")])
def test_plan_fit_of_a_saved_method_fit_from_the_store(tmp_path, method, precondition):
    """trak's kernel (and trackstar's autocorrelation): D^2 float64 factor values, D^2 + D saved; trak's dual Gram
    matrix: N^2, N^2 + N; trackstar's autocorrelation per parameter: sum_p D_p^2, sum_p D_p^2 + D; trackstar's
    denominator: D float32 values. The plan's size is what save_fit writes."""
    torch.manual_seed(0)
    model = tiny.MLP()
    data = _mlp_data()
    store = gradtrace.collect(model, data, store=tmp_path / "s")
    dim = store.dim
    mode = precondition if method == "trak" else "auto"
    structure = "parameter" if precondition == "parameter" else "joint"
    precondition = "autocorrelation" if structure == "parameter" else precondition
    planned = TRAK(mode=mode) if method == "trak" else TrackStar(precondition=precondition, structure=structure)
    got = gradtrace.plan_fit(store, method=planned, out=tmp_path / "f")
    kernel = method == "trak" or precondition == "autocorrelation"
    # the kernels: the Gram matrix of the 12 rows, one per parameter, else the D x D kernel
    sizes = [12] if mode == "dual" else [d for _, d in store.spec.params] if structure == "parameter" else [dim]
    squares, widest = sum(s * s for s in sizes), max(sizes)
    assert (got.examples, got.passes, got.blocks, got.kron_blocks) == (12, int(kernel), len(sizes) if kernel else 1,
                                                                        0)
    assert got.factor_floats == (squares if kernel else dim) and got.factor_itemsize == (8 if kernel else 4)
    assert got.curvature_bytes == (4 * dim if method == "trackstar" else 0) + \
        (8 * (squares + sum(sizes)) if kernel else 0)
    # peak memory of a kernel fit: the kernels + the widest one's eigenvectors and the eigensolver's ~2 size^2
    # workspace, and the blocks of rows read at once (one; the Gram: two)
    assert got.memory_bytes == (8 * (squares + 3 * widest * widest) + 8 * 12 * dim * (2 if mode == "dual" else 1)
                                if kernel else None)
    assert got.kernel_mode == (mode if method == "trak" else None)
    if method == "trak":
        attr = gradtrace.Attributor("trak", store, reweight=False, mode=mode).fit()
        assert attr.method.mode_used == mode
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        for inputs, labels in data:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        attr = gradtrace.Attributor("trackstar", store, precondition=precondition, structure=structure)
        attr.fit(model, optimizer=optimizer)
    gradtrace.save_fit(attr, tmp_path / "f")
    from safetensors import safe_open

    (path,) = (tmp_path / "f").glob("fit-*.safetensors")
    with safe_open(str(path), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        saved = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in names)
    assert saved == got.curvature_bytes
    with pytest.raises(ValueError, match=r"beyond max_dim=10; collect projected gradients"):
        gradtrace.plan_fit(store, method=TRAK(max_dim=10))


def test_plan_fit_takes_the_method_object_or_the_fit_options(tmp_path):
    """A method object's settings and FitOptions give the same plan as the name with the same settings; the
    options' kind is the method's; a float64 covariance is planned with 8-byte factors."""
    torch.manual_seed(0)
    model, data = tiny.MLP(), _mlp_data()
    store = gradtrace.collect(model, data, store=tmp_path / "s")
    by_name = gradtrace.plan_fit(store, model, data, method="kfac", options=FitOptions(kind="ekfac",
                                                                                        fisher="empirical"))
    by_object = gradtrace.plan_fit(store, model, data, method=EKFAC(fisher="empirical"))
    assert (by_name.method, by_name.passes) == ("kfac", 1) and (by_object.method, by_object.passes) == ("ekfac", 2)
    assert by_name.factor_floats == by_object.factor_floats and by_name.factor_itemsize == 4
    ggn = gradtrace.plan_fit(store, model, data, method="ggn", options=FitOptions(fisher="empirical"))
    same = gradtrace.plan_fit(store, model, data, method="fisher", options=FitOptions(fisher="empirical"))
    assert ggn.method == same.method == "fisher" and ggn.factor_floats == same.factor_floats
    wide = gradtrace.plan_fit(store, model, data, method="kfac",
                              options=FitOptions(fisher="empirical", covariance_dtype="float64"))
    assert wide.factor_itemsize == 8 and wide.factor_floats == by_name.factor_floats


def test_plan_fit_refusals(tmp_path):
    model, data = tiny.MLP(), _mlp_data()
    store = gradtrace.collect(model, data, store=tmp_path / "s")
    with pytest.raises(ValueError, match="pass model and data"):
        gradtrace.plan_fit(store, method="ekfac")
    with pytest.raises(ValueError, match="projected space"):
        gradtrace.plan_fit(store, method="logra")
    with pytest.raises(ValueError, match="iterates data twice"):
        gradtrace.plan_fit(store, model, iter(data))
    with pytest.raises(ValueError, match="method must be one of"):
        gradtrace.plan_fit(store, model, data, method="kfca")
    with pytest.raises(ValueError, match="no fit to plan"):
        gradtrace.plan_fit(store, model, data, method=gradtrace.fit.GradDot())
    with pytest.raises(TypeError, match="method name or object"):
        gradtrace.plan_fit(store, model, data, method=3)


@pytest.mark.parametrize("matrix", [True, False])
def test_plan_score_sizes_by_hand(tmp_path, matrix):
    torch.manual_seed(0)
    model = tiny.gpt2()
    store = gradtrace.collect(model, _lm_batches(), store=tmp_path / "s",
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    queries = gradtrace.collect(model, _lm_batches(3, 3), options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    n, d, q, k, block = 10, store.dim, 3, 2, 4
    got = gradtrace.plan_score(store, q, topk=k, matrix=matrix, block_rows=block)
    assert (got.rows, got.dim, got.queries, got.blocks, got.block_rows, got.topk, got.matrix) == \
        (n, d, q, 3, block, k, matrix)
    assert got.block_bytes == 4 * block * d + 4 * q * block  # decode buffer + the block's scores
    assert got.query_bytes == 4 * q * d and got.topk_bytes == 2 * q * 2 * k * 12
    assert got.matrix_bytes == (4 * q * n if matrix else 0)
    assert got.memory_bytes == got.block_bytes + got.query_bytes + got.topk_bytes + got.matrix_bytes
    tensors = (4 * q * n if matrix else 0) + 2 * q * k * (4 + 8)  # matrix, top/bottom values (f32) and indices (i64)
    assert got.output_bytes == tensors + sum(len(f'"{i}"') + 2 for i in store.ids)
    scores = gradtrace.Attributor("grad_dot", store, block_rows=block).score(queries, topk=k, matrix=matrix)
    scores.save(tmp_path / "scores")
    (saved,) = (tmp_path / "scores").glob("*.safetensors")
    assert tensors <= saved.stat().st_size <= tensors + 1024  # the tensors plus the safetensors header
    assert got.seconds == pytest.approx(3 * got.seconds_per_block) and got.seconds_per_block > 0
    auto = gradtrace.plan_score(store, q, matrix="auto", matrix_limit=4 * q * n - 1)
    assert not auto.matrix and gradtrace.plan_score(store, q, matrix="auto", matrix_limit=4 * q * n).matrix
    assert gradtrace.plan_score([store, store], q).checkpoints == 2
