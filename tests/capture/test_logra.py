"""LoGra at capture time equals (P_rows (x) P_cols) vec(dW) of the exact per-example gradient."""

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions
from gradtrace.projection.logra import Projector, gaussian_matrix, stable_seed
from tests import tiny
from tests.capture.test_exact import _lm_batch


def _exact_and_projected(model, spec, run):
    with gradtrace.capture(model) as exact:
        run()
    with gradtrace.capture(model, options=CaptureOptions(projection=spec, verify=True)) as proj:
        run()
    return exact.batches[0], proj.batches[0]


def _kron_project(projector, name, grads):
    """Independent reference: the explicit Kronecker matrix applied to row-major vec(dW)."""
    if grads.dim() == 2:
        mat = projector.matrix(name, "vector", grads.shape[1])
        return grads @ mat.t()
    flat = grads.reshape(grads.shape[0], grads.shape[1], -1)
    rows = projector.matrix(name, "rows", flat.shape[1])
    cols = projector.matrix(name, "cols", flat.shape[2])
    return flat.reshape(grads.shape[0], -1) @ torch.kron(rows, cols).t()


@pytest.mark.parametrize("make", [lambda: tiny.gpt2(tied=True), lambda: tiny.llama()], ids=["gpt2", "llama"])
def test_logra_equals_kronecker_projection_of_exact_gradient(make):
    model = make()
    _, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    spec = gradtrace.LoGra(rank=3, rank_cols=4, vector_rank=5, seed=7)

    def run():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()

    exact, proj = _exact_and_projected(model, spec, run)
    assert proj.projection == spec.to_dict()
    projector = Projector(spec)
    grads = exact.per_example_grads()
    assert set(proj.params) == set(grads)
    for name, full in grads.items():
        want = _kron_project(projector, name, full)
        got = proj.params[name].flat()
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), name
    with pytest.raises(ValueError, match="projected"):
        proj.per_example_grads()


def test_per_parameter_ranks():
    """LoGra(ranks={glob: (rows, cols)}): the matched matrix parameters get their own projected sizes, still equal
    to the Kronecker projection of the exact gradient; the spec round-trips; a glob matching nothing is refused."""
    model = tiny.gpt2(tied=True)
    _, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    spec = gradtrace.LoGra(rank=3, seed=2, ranks={"*wte.weight": (40, 6), "*c_fc.weight": 2})

    def run():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()

    exact, proj = _exact_and_projected(model, spec, run)
    projector = Projector(spec)
    sizes = {}
    for name, full in exact.per_example_grads().items():
        want = _kron_project(projector, name, full)
        got = proj.params[name].flat()
        sizes[name] = got.shape[1]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), name
    assert sizes["transformer.wte.weight"] == 40 * 6
    assert all(size == 4 for name, size in sizes.items() if name.endswith("c_fc.weight"))
    assert sizes["transformer.h.0.attn.c_attn.weight"] == 9 and sizes["transformer.h.0.ln_1.weight"] == 3
    assert gradtrace.LoGra.from_dict(spec.to_dict()).to_dict() == spec.to_dict()
    assert "ranks" not in gradtrace.LoGra(rank=3).to_dict(), "specs without overrides are unchanged"
    with pytest.raises(ValueError, match=r"\['\*lm_head\.bias'\] match no captured parameter"):
        gradtrace.capture(model, options=CaptureOptions(projection=gradtrace.LoGra(rank=3, ranks={"*lm_head.bias": 4})))
    with pytest.raises(ValueError, match="positive integer ranks"):
        gradtrace.LoGra(rank=3, ranks={"*wte*": (0, 3)})


def test_logra_conv_and_keep_tokens():
    model = tiny.ConvNet()
    x, y = torch.randn(4, 2, 8, 8), torch.randint(0, 3, (4,))
    spec = gradtrace.LoGra(rank=4, seed=1, keep_tokens=True)

    def run():
        F.cross_entropy(model(x), y).backward()

    exact, proj = _exact_and_projected(model, spec, run)
    projector = Projector(spec)
    for name, full in exact.per_example_grads().items():
        want = _kron_project(projector, name, full)
        assert torch.allclose(proj.params[name].flat(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), name
    # keep_tokens: per-token projected factors are kept (token axis > 1 for the conv layers)
    assert proj.params["conv1.weight"].terms[0].num_tokens == 64


def test_projection_matrices_are_deterministic_and_distinct():
    a, b = Projector(gradtrace.LoGra(rank=8, seed=0)), Projector(gradtrace.LoGra(rank=8, seed=0))
    assert torch.equal(a.matrix("w", "rows", 33), b.matrix("w", "rows", 33))
    c = Projector(gradtrace.LoGra(rank=8, seed=1))
    assert not torch.equal(a.matrix("w", "rows", 33), c.matrix("w", "rows", 33))
    assert not torch.equal(a.matrix("w", "rows", 33), a.matrix("v", "rows", 33))
    assert not torch.equal(a.matrix("w", "rows", 33), a.matrix("w", "cols", 33))
    # the matrix is a pure function of (scheme, seed, parameter, axis, size, k): no hidden state
    mat = gaussian_matrix(8, 3, stable_seed("gradtrace/logra/v1", 0, "w", "rows", 3, 8))
    assert torch.equal(mat, a.matrix("w", "rows", 3))
    assert stable_seed("x", 1) == stable_seed("x", 1) != stable_seed("x", 2)


def test_projection_matrix_same_on_every_device():
    projector = Projector(gradtrace.LoGra(rank=4, seed=5))
    cpu = projector.matrix("layer.weight", "cols", 10, "cpu")
    meta = projector.matrix("layer.weight", "cols", 10, "meta")
    assert meta.shape == cpu.shape
    if torch.cuda.is_available():
        assert torch.equal(projector.matrix("layer.weight", "cols", 10, "cuda").cpu(), cpu)


def test_projection_preserves_norms_on_average():
    projector = Projector(gradtrace.LoGra(rank=64, seed=0))
    x = torch.randn(200, 256)
    y = projector.project("p", "vector", x)
    ratio = (y.norm(dim=1) / x.norm(dim=1)) ** 2
    assert abs(float(ratio.mean()) - 1) < 0.05
