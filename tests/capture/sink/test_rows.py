"""The row sink: the memory and the shard back end keep the same rows, ids, fields and spec for the same batches."""

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.capture.sink import MemoryRows, RowSink, RowTransform, ShardRows
from gradtrace.grad.batch import GradientBatch
from gradtrace.options import CaptureOptions, StoreOptions
from gradtrace.store import GradientSpec, GradientStore, IdCollision, ShardWriter, SpecMismatch
from tests import tiny
from tests.store.common import status
from tests.store.test_capture import _mlp_batches

IDS = [f"ex{i}" for i in range(12)]
FINGERPRINT = {"class": "MLP", "arch": "0123456789abcdef", "weights": "fedcba9876543210"}


def _batches(nan_example: int | None = 6, ids: list[str] = IDS, epochs: int = 1) -> list[GradientBatch]:
    """Captured batches of the tiny MLP (LoGra rank 3); ``nan_example`` gets a NaN input (flagged by the capture)."""
    model = tiny.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the capture warns about the NaN example
        with gradtrace.capture(model, ids=ids * epochs, keep_batches=True,
                               options=CaptureOptions(projection=gradtrace.LoGra(rank=3))) as cap:
            for _ in range(epochs):
                for x, y in _mlp_batches(nan_example=nan_example):
                    F.cross_entropy(model(x), y).backward()
    return cap.batches


def _to_memory(batches, transform=None) -> tuple[MemoryRows, RowSink]:
    rows = MemoryRows()
    sink = RowSink(rows, transform=transform, fingerprint=lambda: dict(FINGERPRINT))
    for batch in batches:
        sink.add(batch)
    sink.close()
    return rows, sink


def _to_store(path, batches, transform=None) -> tuple[GradientStore, RowSink]:
    sink = RowSink(ShardRows(lambda spec: ShardWriter(path, spec, StoreOptions(shard_rows=5), rank=0, world_size=1)),
                   transform=transform, fingerprint=lambda: dict(FINGERPRINT))
    for batch in batches:
        sink.add(batch)
    sink.close()
    return GradientStore.open(path), sink


def _assert_same(memory: MemoryRows, store: GradientStore) -> None:
    assert memory.ids == store.ids
    assert store.spec == memory.spec
    assert torch.equal(memory.vectors(), store.read(0, len(store)))  # float32 store: bit-exact
    fields = memory.kept_fields()
    assert {name: store.field(name) for name in fields} == fields


def test_memory_and_shards_keep_the_same_rows_and_drop_a_nonfinite_row_alike(tmp_path):
    batches = _batches(nan_example=6)
    memory, _ = _to_memory(batches)
    store, _ = _to_store(tmp_path, batches)
    _assert_same(memory, store)
    assert memory.ids == [i for i in IDS if i != "ex6"]
    want = torch.cat([b.flat() for b in batches])[[k for k, i in enumerate(IDS) if i != "ex6"]]
    assert torch.equal(memory.vectors(), want)
    assert memory.spec == GradientSpec.from_batch(batches[0], model=FINGERPRINT)
    assert memory.kept_fields()["step"] == [0] * 4 + [1] * 3 + [2] * 4
    assert memory.ledger.skipped["nonfinite"] == ["ex6"] == status(tmp_path)["skipped"]["nonfinite"]
    # GradientSet.from_batches is the memory sink
    held = gradtrace.GradientSet.from_batches(batches, FINGERPRINT)
    assert held.ids == memory.ids and torch.equal(held.vectors, memory.vectors()) and held.dropped == ["ex6"]


def test_repeats_are_kept_once_and_counted_alike(tmp_path):
    batches = _batches(nan_example=None, epochs=2)
    memory, _ = _to_memory(batches)
    store, _ = _to_store(tmp_path, batches)
    _assert_same(memory, store)
    assert memory.ids == IDS and memory.ledger.skipped["duplicate"] == 12 == status(tmp_path)["skipped"]["duplicate"]


def test_another_example_under_a_kept_id_is_refused_by_both(tmp_path):
    batches = _batches(nan_example=None)
    renamed = replace(batches[1], ids=list(batches[0].ids))  # other content under the ids of batch 0
    for add in (lambda: _to_memory([batches[0], renamed]), lambda: _to_store(tmp_path, [batches[0], renamed])):
        with pytest.raises(IdCollision, match="names two different examples"):
            add()


class _Halves(RowTransform):
    """A transform: rows keyed ``id/half``, the first half of each vector doubled, one extra field."""

    def spec(self, layout: GradientSpec) -> GradientSpec:
        return replace(layout, params=[("half", layout.dim // 2)], convention={**layout.convention, "features": "t"})

    def keys(self, batch: GradientBatch) -> list[str]:
        return [f"{i}/half" for i in batch.ids]

    def vectors(self, batch: GradientBatch) -> torch.Tensor:
        flat = batch.flat()
        return 2 * flat[:, : flat.shape[1] // 2]

    def fields(self, batch: GradientBatch) -> dict[str, list]:
        return {"size": [len(batch)] * len(batch)}


def test_a_transform_reshapes_spec_keys_vectors_and_fields_in_both_back_ends(tmp_path):
    batches = _batches(nan_example=6)
    memory, sink = _to_memory(batches, _Halves())
    store, _ = _to_store(tmp_path, batches, _Halves())
    _assert_same(memory, store)
    layout = GradientSpec.from_batch(batches[0], model=FINGERPRINT)
    assert sink.layout == layout and memory.spec.params == [("half", layout.dim // 2)]
    assert memory.spec.convention["features"] == "t"
    assert memory.ids == [f"{i}/half" for i in IDS if i != "ex6"]
    full = torch.cat([b.flat() for b in batches])[[k for k, i in enumerate(IDS) if i != "ex6"]]
    assert torch.equal(memory.vectors(), 2 * full[:, : layout.dim // 2])
    assert memory.kept_fields()["size"] == [4] * 4 + [3] * 3 + [4] * 4  # the flagged row left before the transform


def test_rows_made_nonfinite_by_the_transform_are_dropped_with_a_warning_by_both(tmp_path):
    class Overflow(RowTransform):
        def vectors(self, batch):
            out = batch.flat().clone()
            out[[i for i, ident in enumerate(batch.ids) if ident == "ex2"]] = float("inf")
            return out

    batches = _batches(nan_example=None)
    with pytest.warns(UserWarning, match=r"1 row\(s\) with NaN/inf values are not stored: \['ex2'\]"):
        memory, _ = _to_memory(batches, Overflow())
    with pytest.warns(UserWarning, match=r"1 row\(s\) with NaN/inf values are not stored: \['ex2'\]"):
        store, _ = _to_store(tmp_path, batches, Overflow())
    _assert_same(memory, store)
    assert "ex2" not in memory.ids and memory.ledger.skipped["nonfinite"] == ["ex2"]


def test_a_batch_of_another_layout_is_refused():
    batches = _batches(nan_example=None)
    other = replace(batches[1], projection={"kind": "other"})
    rows = MemoryRows()
    sink = RowSink(rows, what="the first batch")
    sink.add(batches[0])
    with pytest.raises(SpecMismatch, match="backward pass 1 captured other parameters or another projection than "
                                           "the first batch"):
        sink.add(other)
