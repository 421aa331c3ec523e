"""Capture under DistributedDataParallel (2 gloo ranks on CPU) equals one process capturing every example.

Each rank trains on its half of the examples. Whether the capture's hooks are installed before DDP wraps
the model, on the DDP wrapper or on the inner module after wrapping, exact and LoGra-projected, every
rank's per-example gradients equal the single-process ones (by example id); ``param.grad`` is bitwise
what the same DDP step computes without the capture; capture callbacks run after DDP's all-reduce (they
see the final ``param.grad``); and a store written by both ranks reads back as one store equal to the
single-process vectors.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

import gradtrace
from gradtrace.options import CaptureOptions
from gradtrace.store import GradientStore, model_fingerprint
from tests import tiny
from tests.distributed import jobs
from tests.distributed.launch import run_ranks

MODES = ("before", "wrapper", "inner")


@functools.cache
def _reference(kind: str, logra: bool):
    return jobs.single_process(kind, logra)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """``{kind: (per-rank results, store path)}``, one 2-rank run per model kind (run on first use)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            store = tmp_path_factory.mktemp(f"ddp-{kind}") / "store"
            cache[kind] = (run_ranks(jobs.ddp_capture, kind, str(store), timeout=60), store)
        return cache[kind]

    return get


def _assert_equal_by_id(got: dict, want: dict, logra: bool) -> None:
    for ident, grads in got.items():
        if logra:
            torch.testing.assert_close(grads, want[ident], rtol=1e-4, atol=1e-6)
        else:
            tiny.assert_grads_close({n: g[None] for n, g in grads.items()},
                                    {n: g[None] for n, g in want[ident].items()})


@pytest.mark.parametrize("kind", ["gpt2", "mlp", "moe"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logra", [False, True], ids=["exact", "logra"])
def test_ddp_per_example_grads_equal_one_process(ddp_runs, kind, mode, logra):
    results, _ = ddp_runs(kind)
    want = _reference(kind, logra)
    for rank, result in enumerate(results):
        run = result[mode, logra]
        assert sorted(run["grads"]) == [jobs.IDS[i] for i in jobs.rows_of(rank, 2)], "each rank: its own examples"
        _assert_equal_by_id(run["grads"], want, logra)
        assert run["ok"]


@pytest.mark.parametrize("kind", ["gpt2", "mlp"])
def test_ddp_param_grad_unchanged_and_seen_by_callbacks(ddp_runs, kind):
    results, _ = ddp_runs(kind)
    for result in results:
        for mode in MODES:
            for logra in (False, True):
                run = result[mode, logra]
                assert run["grads_unchanged"], f"{mode}, logra={logra}: param.grad differs without capture"
                assert run["callbacks_see_final"], f"{mode}, logra={logra}: a callback ran before DDP's all-reduce"


@pytest.mark.parametrize("kind", ["gpt2", "mlp"])
def test_ddp_store_written_by_both_ranks_reads_as_one(ddp_runs, kind):
    _, path = ddp_runs(kind)
    store = GradientStore.open(path)
    assert store.complete and sorted(store.ranks) == [0, 1]
    assert {s.rank for s in store.shards} == {0, 1}
    assert sorted(store.ids) == sorted(jobs.IDS)
    want = _reference(kind, True)
    vectors = store.read(0, len(store))
    for row, ident in enumerate(store.ids):
        torch.testing.assert_close(vectors[row], want[ident], rtol=1e-4, atol=1e-6)
    assert store.spec.model == model_fingerprint(jobs.build(kind))


def test_collect_into_one_store_from_every_rank(tmp_path):
    """``collect(store=...)`` under torchrun: each rank collects its share; the store is complete on every rank as
    soon as collect returns (the ranks' writers wait for each other when the capture ends)."""
    results = run_ranks(jobs.collect_store, str(tmp_path / "store"), timeout=60)
    assert results == [{"ids": jobs.IDS, "complete": True}] * 2
    first = GradientStore.open(tmp_path / "store").manifest["created"]
    # again with overwrite=True, rank 1 first: rank 0 replaces the old store before any writer opens
    time.sleep(1.1)  # manifests record seconds
    results = run_ranks(jobs.collect_store, str(tmp_path / "store"), True, timeout=60)
    assert results == [{"ids": jobs.IDS, "complete": True}] * 2
    store = GradientStore.open(tmp_path / "store")
    assert store.manifest["created"] != first and len(store) == len(jobs.IDS)
    model = jobs.build("gpt2")
    reference = gradtrace.collect(model, [{"id": jobs.IDS, **{k: v for k, v in jobs.dataset("gpt2").items()
                                                              if k != "labels"}}],
                                  options=CaptureOptions(projection=gradtrace.LoGra(**jobs.LOGRA)))
    want = dict(zip(reference.ids, reference.vectors))
    vectors = store.read(0, len(store))
    for row, ident in enumerate(store.ids):
        torch.testing.assert_close(vectors[row], want[ident], rtol=1e-4, atol=1e-6)
