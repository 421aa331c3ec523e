"""One Projection protocol: LoGra and the sketches implement it, and projection specs (as stores record them) are
rebuilt by kind through one registry (issue #16)."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.projection import (
    DenseProjection,
    LoGra,
    Projection,
    ProjectionError,
    Projector,
    SparseProjection,
    projection_from_dict,
)
from tests import tiny

SPECS = [LoGra(rank=3, seed=5), LoGra(rank=2, rank_cols=4, vector_rank=3, ranks={"*.weight": (2, 5)}),
         DenseProjection(8, seed=1), DenseProjection(8, seed=1, kind="rademacher"), SparseProjection(8, seed=2, nnz=2)]


@pytest.mark.parametrize("projection", SPECS, ids=lambda p: type(p).__name__)
def test_every_projection_round_trips_through_the_registry(projection):
    assert isinstance(projection, Projection)
    rebuilt = projection_from_dict(projection.to_dict())
    assert type(rebuilt) is type(projection) and rebuilt.to_dict() == projection.to_dict()
    grads = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
    flat = grads.reshape(4, -1) if not isinstance(projection, LoGra) else grads
    assert torch.equal(rebuilt.project(flat, "layer.weight"), projection.project(flat, "layer.weight"))


def test_logra_project_is_what_capture_computes():
    spec = LoGra(rank=3, vector_rank=2, seed=7)
    projector = Projector(spec)
    matrices = torch.randn(5, 6, 4, dtype=torch.float64)  # [E, rows, cols]
    rows, cols = projector.matrix("w", "rows", 6).double(), projector.matrix("w", "cols", 4).double()
    expected = torch.stack([rows @ g @ cols.t() for g in matrices]).reshape(5, -1)  # P_r G P_c^T, in float64
    # float32 products of O(1) numbers over <= 6 terms: a few float32 ulps of the O(10) results
    torch.testing.assert_close(spec.project(matrices, "w").double(), expected, rtol=1e-5, atol=1e-5)
    vectors = torch.randn(5, 6)
    assert torch.equal(spec.project(vectors, "b"), vectors @ projector.matrix("b", "vector", 6).t())


def test_specs_of_other_kinds_are_refused_with_one_line():
    assert projection_from_dict(None) is None
    with pytest.raises(ProjectionError, match="'gaussian' projection; this rebuilds LoGra projections only"):
        projection_from_dict(DenseProjection(4).to_dict(), expect=LoGra, what="the gradients of store s")
    with pytest.raises(ProjectionError, match="'less' projection"):  # LESS features: not a capture projection
        projection_from_dict({"kind": "less", "sketch": DenseProjection(4).to_dict(), "inputs": []}, expect=LoGra)
    with pytest.raises(ProjectionError, match="does not know"):
        projection_from_dict({"kind": "nope"})
    incomplete = {k: v for k, v in LoGra(rank=2).to_dict().items() if k != "rank_cols"}
    with pytest.raises(ProjectionError, match="incomplete"):
        projection_from_dict(incomplete)


def test_a_pca_projection_is_not_rebuilt_without_its_basis():
    model = tiny.MLP()
    x, y = torch.randn(16, 7), torch.randint(0, 4, (16,))
    pca = gradtrace.LoGra.pca(model, [(x[:8], y[:8]), (x[8:], y[8:])], rank=2)
    spec = pca.to_dict()
    assert spec["init"] == "pca" and spec["basis"] == pca.basis.fingerprint
    with pytest.raises(ProjectionError, match="cannot reproduce"):
        projection_from_dict(spec, expect=LoGra)
    # the same basis handed over again (a fitted curvature) projects identically
    again = LoGra(rank=2, init="pca", basis=pca.basis.curvature)
    assert again.to_dict() == spec
    grads = torch.randn(3, *dict(model.named_parameters())["net.0.weight"].shape)
    assert torch.equal(again.project(grads, "net.0.weight"), pca.project(grads, "net.0.weight"))
