"""Artifacts written by gradtrace's first on-disk formats (``tests/fixtures/v1``, made by
``tests/fixtures/make_v1.py``) still open, load and score as they did when they were written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.curvature import Curvature
from gradtrace.store.artifact import UncheckedArtifactWarning

V1 = Path(__file__).parent.parent / "fixtures" / "v1"


def _copy(tmp_path: Path) -> Path:
    """A writable copy (opening must not need to write, but a test must never touch the checked-in files)."""
    shutil.copytree(V1, tmp_path / "v1")
    return tmp_path / "v1"


def test_v1_store_opens_verified_with_its_rows(tmp_path):
    root = _copy(tmp_path)
    store = gradtrace.GradientStore.open(root / "store", verify=True)
    assert len(store) == 8 and store.dim == 232 and store.spec.dtype == "int8" and len(store.shards) == 2
    assert len(set(store.ids)) == 8 and store.complete
    rows = store.read(0, 8)
    assert rows.shape == (8, 232) and torch.isfinite(rows).all() and (rows.abs().sum(1) > 0).all()


def test_v1_curvature_and_scores_load_and_rescore_the_same(tmp_path):
    root = _copy(tmp_path)
    store = gradtrace.GradientStore.open(root / "store")
    with pytest.warns(UncheckedArtifactWarning, match="no checksums"):  # version 1 recorded none
        curvature = Curvature.load(root / "curvature")
    assert curvature.kind == "kfac" and curvature.spec.params == store.spec.params
    with pytest.warns(UncheckedArtifactWarning, match="no checksums"):
        saved = gradtrace.Scores.load(root / "scores")
    assert saved.method == "kfac" and saved.train_ids == store.ids and saved.query_ids == store.ids[:3]
    queries = gradtrace.GradientSet(store.read(0, 3), store.ids[:3], store.spec)
    again = gradtrace.Attributor("kfac", store, curvature=curvature).score(queries, topk=4, matrix=True)
    # the same float32 computation on another machine: BLAS round-off only
    scale = float(saved.matrix.abs().max())
    torch.testing.assert_close(again.matrix, saved.matrix, rtol=1e-4, atol=1e-4 * scale)
    assert again.topk(4).ids == saved.topk(4).ids
