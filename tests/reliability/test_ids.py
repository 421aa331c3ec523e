"""Example identity: the in-memory and the store path keep the same rows; a repeat of an example is skipped and
counted, two different examples sharing an id (or ids of two types) are an error naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.capture.gradient_set import GradientSet
from gradtrace.options import RunOptions, StoreOptions
from gradtrace.store import GradientStore, IdCollision, StoreError, StoreWriter
from tests import tiny


def _examples(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, 7, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _model() -> tiny.MLP:
    torch.manual_seed(0)
    return tiny.MLP()


def _status(path: Path) -> dict:
    return json.loads((path / "rank-00000.json").read_text())


def test_a_repeated_example_is_kept_once_and_counted_in_both_paths(tmp_path):
    x, y = _examples()
    order = [0, 1, 2, 3, 1, 4, 5, 6, 7, 3]  # examples 1 and 3 come twice, with their ids
    ids = [f"ex{i}" for i in order]
    memory = gradtrace.collect(_model(), _batches(x[order], y[order]), run=RunOptions(ids=ids))
    store = gradtrace.collect(_model(), _batches(x[order], y[order]), store=tmp_path / "s",
                              store_options=StoreOptions(shard_rows=4), run=RunOptions(ids=ids))
    want = [f"ex{i}" for i in range(8)]
    assert memory.ids == store.ids == want
    assert torch.equal(memory.read(0, 8), store.read(0, 8))  # the same computation: bit-identical
    assert memory.skipped == {"nonfinite": [], "duplicate": 2}
    assert _status(tmp_path / "s")["skipped"]["duplicate"] == 2
    reference = gradtrace.collect(_model(), _batches(x, y), run=RunOptions(ids=want))
    assert store.field("digest") == _digests()  # recorded per row: a resumed run compares with them
    # the same examples in other batches: equal up to float32 round-off of the batched products (entries are
    # sums of a few terms of magnitude <= max|g|; 8 ulps of the largest entry bounds a reordered sum)
    scale = reference.vectors.abs().max().item()
    torch.testing.assert_close(memory.vectors, reference.vectors, rtol=0,
                               atol=8 * torch.finfo(torch.float32).eps * scale)


def _digests() -> list[str]:
    """The content digests the capture gives examples 0..7."""
    model = _model()
    x, y = _examples()
    with gradtrace.capture(model) as cap:
        for bx, by in _batches(x, y):
            F.cross_entropy(model(bx), by, reduction="sum").backward()
    return [d for b in cap.batches for d in b.meta["digest"]]


@pytest.mark.parametrize("where", ["memory", "store"])
def test_two_examples_sharing_an_id_are_an_error_in_both_paths(tmp_path, where):
    x, y = _examples()
    ids = [f"ex{i}" for i in range(8)]
    ids[6] = "ex1"  # example 6 is another example than example 1
    store = tmp_path / "s" if where == "store" else None
    with pytest.raises(IdCollision, match=r"id 'ex1' names two different examples \(content digests [0-9a-f]{16} and "
                                          r"[0-9a-f]{16}.*give every example its own id"):
        gradtrace.collect(_model(), _batches(x, y), store=store, store_options=StoreOptions(shard_rows=2),
                          run=RunOptions(ids=ids))
    if where == "store":  # what was committed before the collision is kept, and the store says it is unfinished
        with pytest.raises(StoreError, match=r"incomplete \(rank 0: interrupted\)"):
            GradientStore.open(store)
        partial = GradientStore.open(store, allow_incomplete=True)
        assert partial.ids == ids[:len(partial)] and len(partial) >= 2


def test_a_resumed_run_compares_contents_with_what_the_store_holds(tmp_path):
    x, y = _examples()
    model = _model()

    def run(ids, rows, resume):
        with gradtrace.capture(model, ids=ids,
                               callbacks=[StoreWriter(tmp_path, StoreOptions(shard_rows=2, resume=resume))]):
            for bx, by in _batches(x[rows], y[rows]):
                F.cross_entropy(model(bx), by, reduction="sum").backward()

    run([f"ex{i}" for i in range(4)], [0, 1, 2, 3], resume=False)
    run(["ex2", "ex3", "ex4", "ex5"], [2, 3, 4, 5], resume=True)  # repeats of stored examples: skipped
    assert GradientStore.open(tmp_path).ids == [f"ex{i}" for i in range(6)]
    assert _status(tmp_path)["skipped"]["already_stored"] == 2
    with pytest.raises(IdCollision, match=r"id 'ex0' names two different examples .* stored in"):
        run(["ex0"], [7], resume=True)  # another example under a stored id
    assert GradientStore.open(tmp_path, allow_incomplete=True).ids == [f"ex{i}" for i in range(6)]


def test_without_digests_a_repeated_id_is_a_repeat(tmp_path):
    """Batches that carry no content digest (built by hand, or inputs that cannot be hashed): an id seen before
    is taken to be the same example, as the store always did."""
    x, y = _examples()
    model = _model()
    with gradtrace.capture(model, ids=["a", "b", "c", "a", "d", "e"]) as cap:
        for bx, by in _batches(x[:6], y[:6]):
            F.cross_entropy(model(bx), by, reduction="sum").backward()
    for batch in cap.batches:
        batch.meta.pop("digest")
    out = GradientSet.from_batches(cap.batches)
    assert out.ids == ["a", "b", "c", "d", "e"] and out.skipped["duplicate"] == 1


@pytest.mark.parametrize("where", ["memory", "store"])
@pytest.mark.parametrize("given", ["ids", "column"])
def test_ids_of_two_types_are_refused(tmp_path, where, given):
    x, y = _examples(4)
    ids = [1, "1", 2, 3]  # 1 and "1" would both be stored as "1"
    store = tmp_path / "s" if where == "store" else None
    if given == "ids":
        data, options = _batches(x, y, 2), {"run": RunOptions(ids=ids)}
    else:  # an id column in dict batches
        data, options = [{"x": x[i:i + 2], "y": y[i:i + 2], "id": ids[i:i + 2]} for i in (0, 2)], {}

    def loss(model, batch):
        if isinstance(batch, dict):
            batch = (batch["x"], batch["y"])
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    with pytest.raises(IdCollision, match=r"ids of two types in one run: 1 \(int\) and '1' \(str\)"):
        gradtrace.collect(_model(), data, loss, store=store, **options)


def test_one_id_type_is_fine_and_annotate_is_checked_too():
    x, y = _examples(4)
    model = _model()
    with gradtrace.capture(model) as cap:
        cap.annotate(ids=[10, 11])
        F.cross_entropy(model(x[:2]), y[:2]).backward()
        cap.annotate(ids=["10", "12"])
        with pytest.raises(IdCollision, match=r"10 \(int\) and '10' \(str\)"):
            F.cross_entropy(model(x[2:]), y[2:]).backward()
    assert cap.batches[0].ids == ["10", "11"]


def test_a_saved_gradient_set_keeps_its_digests(tmp_path):
    x, y = _examples()
    memory = gradtrace.collect(_model(), _batches(x, y), run=RunOptions(ids=[f"ex{i}" for i in range(8)]))
    assert memory.field("digest") == _digests()
    saved = memory.save(tmp_path / "s")
    assert saved.ids == memory.ids and saved.field("digest") == _digests()
    assert torch.equal(saved.read(0, 8), memory.vectors)
