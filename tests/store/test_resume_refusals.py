"""Resuming a store with other weights, another projection or another loss convention is refused before any
gradient is taken (naming what differs), and the store is left as it was: rows of two runs are never mixed."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.options import CaptureOptions, Loss, RunOptions, StoreOptions
from gradtrace.store import GradientStore, SpecMismatch
from tests import tiny

NUM = 6


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(NUM, 7, generator=gen), torch.randint(0, 4, (NUM,), generator=gen)
    return [(x[i:i + 2], y[i:i + 2]) for i in range(0, NUM, 2)]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny.MLP()


class _Counting(list):
    """Batches that count how many were taken (no gradient may be taken before a refusal)."""

    def __init__(self, items: list) -> None:
        super().__init__(items)
        self.taken = 0

    def __iter__(self):
        for item in super().__iter__():
            self.taken += 1
            yield item


@pytest.fixture
def half(tmp_path):
    """A store holding the first 4 of the 6 examples, collected with LoGra rank 2 from the seed-0 model."""
    path = tmp_path / "store"
    gradtrace.collect(_model(), _batches()[:2], store=path, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                      run=RunOptions(ids=[f"ex{i}" for i in range(4)]))
    return path


def _files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("model_seed", "projection", "message"), [
    (1, gradtrace.LoGra(rank=2), r"collected with other model weights \(fingerprint [0-9a-f]{16}, this model's"),
    (0, gradtrace.LoGra(rank=3), r"collected with projection .*'rank_rows': 2.*this run asks for .*'rank_rows': 3"),
    (0, gradtrace.LoGra(rank=2, seed=7), r"collected with projection .*'seed': 0.*'seed': 7"),
    (0, None, r"collected with projection \{.*\}, this run asks for None"),
])
def test_collect_resume_refuses_another_model_or_projection(half, model_seed, projection, message):
    before = _files(half)
    data = _Counting(_batches())
    with pytest.raises(SpecMismatch, match=rf"cannot resume .*store: it was {message}.*overwrite=True\); rows of"):
        gradtrace.collect(_model(model_seed), data, store=half, options=CaptureOptions(projection=projection),
                          store_options=StoreOptions(resume=True), run=RunOptions(ids=[f"ex{i}" for i in range(NUM)]))
    assert data.taken == 0  # refused before any gradient
    assert _files(half) == before


def test_collect_resume_with_the_same_settings_adds_the_rest(half):
    store = gradtrace.collect(_model(), _batches(), store=half,
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                              store_options=StoreOptions(resume=True),
                              run=RunOptions(ids=[f"ex{i}" for i in range(NUM)]))
    assert sorted(store.ids) == [f"ex{i}" for i in range(NUM)]


def test_store_writer_resume_refuses_another_loss_convention(half):
    """A capture of the per-example mean loss cannot add rows to a store of per-example summed losses."""
    before = _files(half)
    x, y = _batches()[2]
    model = _model()
    writer = gradtrace.StoreWriter(half, StoreOptions(resume=True))
    message = r"different loss conventions \(gradients of the per-example 'sum' loss vs the 'mean' loss\)"
    with pytest.raises(SpecMismatch, match=message), \
            gradtrace.capture(model, Loss(reduction="sum", example_loss="mean"),
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2)), ids=["ex4", "ex5"],
                              callbacks=[writer]):
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert _files(half) == before
    assert len(GradientStore.open(half)) == 4


def test_store_writer_resume_refuses_other_weights(half):
    x, y = _batches()[2]
    model = _model(seed=1)
    writer = gradtrace.StoreWriter(half, StoreOptions(resume=True))
    with pytest.raises(SpecMismatch, match="collected with other model weights"), \
            gradtrace.capture(model, Loss(reduction="sum"), options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                              ids=["ex4", "ex5"], callbacks=[writer]):
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert len(GradientStore.open(half)) == 4
