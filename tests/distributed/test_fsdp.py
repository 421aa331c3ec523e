"""Capture under FSDP2 (``fully_shard``, 2 gloo ranks on CPU) equals one process capturing every example.

Parameters are sharded DTensors outside forward and unsharded tensors swapped in during it. The capture
(hooks installed before or after ``fully_shard``), its parameter hooks (``verify=True`` compares every
per-example sum with the gradient the hooks saw; functional use is still reported), the probing of Hugging
Face norm classes (Llama's RMSNorm, itself an FSDP module here), ``model_fingerprint`` (a collective: equal
to the unsharded model's) and a store written from the capture callbacks all behave: no hang, and the same
numbers as one process. FSDP1 is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from gradtrace.store import GradientStore, model_fingerprint
from tests.distributed import jobs
from tests.distributed.launch import run_ranks
from tests.distributed.test_ddp import _assert_equal_by_id, _reference  # one cached single-process reference

MODES = ("before", "after")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            store = tmp_path_factory.mktemp(f"fsdp-{kind}") / "store"
            cache[kind] = (run_ranks(jobs.fsdp_capture, kind, str(store), timeout=60), store)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mlp", "moe"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logra", [False, True], ids=["exact", "logra"])
def test_fsdp2_per_example_grads_equal_one_process(fsdp_runs, kind, mode, logra):
    results, _ = fsdp_runs(kind)
    want = _reference(kind, logra)
    for rank, result in enumerate(results):
        run = result[mode, logra]
        assert sorted(run["grads"]) == [jobs.IDS[i] for i in jobs.rows_of(rank, 2)]
        _assert_equal_by_id(run["grads"], want, logra)
        assert run["ok"], run["report"]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mlp"])
def test_fsdp2_sharded_grads_unchanged_fingerprint_and_store(fsdp_runs, kind):
    results, path = fsdp_runs(kind)
    for result in results:
        for mode in MODES:
            for logra in (False, True):
                run = result[mode, logra]
                assert run["grads_unchanged"], f"{mode}, logra={logra}: sharded param.grad differs without capture"
                assert run["callbacks_see_final"], f"{mode}, logra={logra}: a callback ran before the reduce-scatter"
    single = model_fingerprint(jobs.build(kind))
    assert [r["fingerprint"] for r in results] == [single, single]
    if kind == "llama":
        report = results[0]["after", False]["report"]
        assert "model.layers.0.input_layernorm" in report and "rmsnorm" in report  # probed, verified, captured
    store = GradientStore.open(path)
    assert store.complete and sorted(store.ids) == sorted(jobs.IDS) and store.spec.model == single
    want = _reference(kind, True)
    vectors = store.read(0, len(store))
    for row, ident in enumerate(store.ids):
        torch.testing.assert_close(vectors[row], want[ident], rtol=1e-4, atol=1e-6)


def test_fsdp2_functional_use_is_reported_and_fsdp1_refused():
    for result in run_ranks(jobs.fsdp_functional, timeout=60):
        assert sorted(result["functional"]) == ["head.bias", "head.weight"]
        assert any("functional use" in w for w in result["warnings"])
        assert "head.weight, head.bias in head" in result["error"] and "exclude=['head']" in result["error"]
        assert "FSDP1" in result["fsdp1"] and "fully_shard" in result["fsdp1"]
