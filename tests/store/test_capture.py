"""StoreWriter as a capture callback: the store holds exactly the captured vectors, described by its manifest."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions, StoreOptions
from gradtrace.store import GradientStore, ShardWriter, StoreError, StoreWriter, model_fingerprint
from tests import tiny
from tests.capture.test_exact import _lm_batch
from tests.store.common import make_rows, make_spec, status


def test_gpt2_training_steps_with_logra_store(tmp_path):
    model = tiny.gpt2()
    before = model_fingerprint(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = gradtrace.LoGra(rank=4)
    lengths = [[5, 8, 3], [6, 6, 2, 7], [4, 9]]
    ids = [f"doc{i}" for i in range(sum(len(x) for x in lengths))]
    store = StoreWriter(tmp_path, StoreOptions(shard_rows=4, config={"task": "tiny"}))
    with gradtrace.capture(model, ids=ids, callbacks=[store], keep_batches=True,
                           options=CaptureOptions(projection=spec)) as cap:
        for step_lengths in lengths:
            _, input_ids, mask, labels, pos = _lm_batch(step_lengths)
            model(input_ids=input_ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert len(cap.batches) == 3
    opened = GradientStore.open(tmp_path)
    assert opened.ids == ids
    want = torch.cat([b.flat() for b in cap.batches])
    assert torch.equal(opened.read(0, len(opened)), want)
    assert opened.field("step") == [b.step for b in cap.batches for _ in b.ids]
    assert [s.rows for s in opened.shards] == [4, 4, 1]

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["schema_version"] == 2 and manifest["format"] == "gradtrace-store"
    assert manifest["spec"]["projection"] == spec.to_dict()
    assert manifest["spec"]["convention"] == {"reduction": "mean", "example_loss": "sum"}
    assert manifest["spec"]["model"] == before  # taken at the first backward pass, before any update
    assert manifest["spec"]["model"]["class"] == "GPT2LMHeadModel"
    assert manifest["spec"]["params"] == [[n, d] for n, d in cap.batches[0].dims.items()]
    # the user's config as given, and the capture's coverage (the whole model: GPT-2's tied weight counted once)
    assert manifest["config"] == {"task": "tiny", "gradtrace": {"coverage": cap.coverage().to_dict()}}
    assert manifest["config"]["gradtrace"]["coverage"]["share"] == 1.0
    assert opened.spec.dim == want.shape[1]
    after = model_fingerprint(model)
    assert after["arch"] == before["arch"] and after["weights"] != before["weights"]
    assert status(tmp_path)["status"] == "complete"


def _mlp_batches(n_batches=3, batch=4, nan_example=None):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n_batches * batch, 7, generator=gen)
    y = torch.randint(0, 4, (n_batches * batch,), generator=gen)
    if nan_example is not None:
        x[nan_example, 2] = float("nan")
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]


def test_nonfinite_examples_are_skipped_and_listed(tmp_path):
    model = tiny.MLP()
    ids = [f"ex{i}" for i in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the capture warns about the NaN example
        with gradtrace.capture(model, ids=ids, keep_batches=True,
                               callbacks=[StoreWriter(tmp_path, StoreOptions(shard_rows=5))],
                               options=CaptureOptions(projection=gradtrace.LoGra(rank=3))) as cap:
            for x, y in _mlp_batches(nan_example=6):
                F.cross_entropy(model(x), y).backward()
    flagged = [i for b in cap.batches for i, bad in zip(b.ids, b.nonfinite.tolist()) if bad]
    assert flagged == ["ex6"]
    store = GradientStore.open(tmp_path)
    assert store.ids == [i for i in ids if i != "ex6"]
    want = torch.cat([b.flat() for b in cap.batches])
    keep = [k for k, i in enumerate(ids) if i != "ex6"]
    assert torch.equal(store.read(0, len(store)), want[keep])
    assert torch.isfinite(store.read(0, len(store))).all()
    assert status(tmp_path)["skipped"]["nonfinite"] == ["ex6"]


def test_nonfinite_rows_put_directly_are_skipped_and_kept_listed_on_resume(tmp_path):
    ids, rows = make_rows(6)
    rows[1, 3] = float("inf")
    rows[4, 0] = float("nan")
    with pytest.warns(UserWarning, match="2 row"), \
            ShardWriter(tmp_path, make_spec("int8"), StoreOptions(shard_rows=2)) as writer:
        writer.put(ids, rows)
    assert status(tmp_path)["skipped"]["nonfinite"] == [ids[1], ids[4]]
    ShardWriter(tmp_path, make_spec("int8"), StoreOptions(resume=True)).close()
    assert status(tmp_path)["skipped"]["nonfinite"] == [ids[1], ids[4]]
    store = GradientStore.open(tmp_path)
    assert store.ids == [ids[i] for i in (0, 2, 3, 5)]


def test_capture_that_raises_leaves_an_interrupted_store(tmp_path):
    model = tiny.MLP()
    with pytest.raises(RuntimeError, match="boom"), gradtrace.capture(
            model, ids=[f"ex{i}" for i in range(12)], callbacks=[StoreWriter(tmp_path, StoreOptions(shard_rows=3))]):
        for step, (x, y) in enumerate(_mlp_batches()):
            F.cross_entropy(model(x), y).backward()
            if step == 1:
                raise RuntimeError("boom")
    with pytest.raises(StoreError, match=r"incomplete \(rank 0: interrupted\)"):
        GradientStore.open(tmp_path)
    assert len(GradientStore.open(tmp_path, allow_incomplete=True)) == 8  # everything queued is written
    assert not (tmp_path / "rank-00000.lock").exists()


def test_later_epochs_do_not_store_an_example_twice(tmp_path):
    model = tiny.MLP()
    data = _mlp_batches()
    with gradtrace.capture(model, ids=[f"ex{i}" for i in range(12)] * 2,
                           callbacks=[StoreWriter(tmp_path, StoreOptions(shard_rows=5))], keep_batches=True) as cap:
        for _ in range(2):
            for x, y in data:
                F.cross_entropy(model(x), y).backward()
    store = GradientStore.open(tmp_path)
    assert store.ids == [f"ex{i}" for i in range(12)]
    assert torch.equal(store.read(0, 12), torch.cat([b.flat() for b in cap.batches[:3]]))
    assert status(tmp_path)["skipped"]["duplicate"] == 12
