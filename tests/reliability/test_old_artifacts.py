"""Artifacts written by earlier on-disk formats (``tests/fixtures/v1``: the first formats, no checksums;
``tests/fixtures/v2``: store schema 2 with checksummed curvature and scores, written before the architecture
step of issue #16; both made by ``tests/fixtures/make_fixtures.py``) still open, load and score as they did
when they were written."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.fit.curvature import Curvature
from gradtrace.store.artifact import UncheckedArtifactWarning

FIXTURES = Path(__file__).parent.parent / "fixtures"
VERSIONS = ["v1", "v2"]


def _copy(tmp_path: Path, version: str) -> Path:
    """A writable copy (opening must not need to write, but a test must never touch the checked-in files)."""
    shutil.copytree(FIXTURES / version, tmp_path / version)
    return tmp_path / version


def _loading(version: str):
    """Version 1 recorded no checksums and loads with a warning that says so; later versions load silently."""
    if version == "v1":
        return pytest.warns(UncheckedArtifactWarning, match="no checksums")
    return contextlib.nullcontext()


@pytest.mark.parametrize("version", VERSIONS)
def test_old_store_opens_verified_with_its_rows(tmp_path, version):
    root = _copy(tmp_path, version)
    store = gradtrace.GradientStore.open(root / "store", verify=True)
    assert len(store) == 8 and store.dim == 232 and store.spec.dtype == "int8" and len(store.shards) == 2
    assert len(set(store.ids)) == 8 and store.complete
    rows = store.read(0, 8)
    assert rows.shape == (8, 232) and torch.isfinite(rows).all() and (rows.abs().sum(1) > 0).all()


@pytest.mark.parametrize("version", VERSIONS)
def test_old_curvature_and_scores_load_and_rescore_the_same(tmp_path, version):
    root = _copy(tmp_path, version)
    store = gradtrace.GradientStore.open(root / "store")
    with _loading(version):
        curvature = Curvature.load(root / "curvature")
    assert curvature.kind == "kfac" and curvature.spec.params == store.spec.params
    with _loading(version):
        saved = gradtrace.Scores.load(root / "scores")
    assert saved.method == "kfac" and saved.train_ids == store.ids and saved.query_ids == store.ids[:3]
    queries = gradtrace.GradientSet(store.read(0, 3), store.ids[:3], store.spec)
    again = gradtrace.Attributor("kfac", store, curvature=curvature).score(queries, topk=4, matrix=True)
    # the same float32 computation on another machine: BLAS round-off only
    scale = float(saved.matrix.abs().max())
    torch.testing.assert_close(again.matrix, saved.matrix, rtol=1e-4, atol=1e-4 * scale)
    assert again.topk(4).ids == saved.topk(4).ids
