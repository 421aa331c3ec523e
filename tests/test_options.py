"""Typed option objects (gradtrace.options): the keyword and options spellings are the same call, a setting given
both ways or one the entry point fixes is an error, and artifacts record the resolved objects."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.curvature import fit_curvature
from gradtrace.options import CaptureOptions, FitOptions, StoreOptions, record
from tests import tiny


def _lm_batches(n: int = 12, t: int = 8, batch: int = 4) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(1, tiny.VOCAB, (n, t), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + batch], "id": [f"e{j}" for j in range(i, i + batch)]} for i in range(0, n, batch)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny.gpt2(tied=True)


def test_keyword_and_options_spellings_write_identical_stores(tmp_path):
    model, batches = _model(), _lm_batches()
    projection = gradtrace.LoGra(rank=4, seed=3)
    layers = ["*.mlp.*", "lm_head"]
    by_keyword = gradtrace.collect(model, batches, projection=projection, layers=layers, store=tmp_path / "kw",
                                   dtype="bfloat16", shard_rows=5)
    by_options = gradtrace.collect(model, batches, store=tmp_path / "opt",
                                   options=CaptureOptions(projection=projection, layers=layers),
                                   store_options=StoreOptions(dtype="bfloat16", shard_rows=5))
    assert by_keyword.ids == by_options.ids == [f"e{i}" for i in range(12)]
    assert torch.equal(by_keyword.read(0, 12), by_options.read(0, 12))  # bit-identical rows
    assert by_keyword.spec == by_options.spec
    recorded = by_options.manifest["config"]["gradtrace"]["options"]
    assert recorded == by_keyword.manifest["config"]["gradtrace"]["options"]
    assert recorded["store"] == {"dtype": "bfloat16", "resume": False, "overwrite": False, "shard_bytes": None,
                                 "shard_rows": 5}
    assert recorded["capture"]["projection"] == projection.to_dict() and recorded["capture"]["layers"] == layers
    assert recorded == {"capture": record(CaptureOptions(projection=projection, layers=layers)),
                        "store": record(StoreOptions(dtype="bfloat16", shard_rows=5))}


def test_a_setting_given_both_ways_is_an_error(tmp_path):
    model, batches = _model(), _lm_batches()
    with pytest.raises(ValueError, match=r"collect\(\): dtype given both as a keyword argument and in store_options="):
        gradtrace.collect(model, batches, store=tmp_path / "s", dtype="int8", store_options=StoreOptions())
    with pytest.raises(ValueError, match="layers given both"):
        gradtrace.capture(model, layers=["lm_head"], options=CaptureOptions(layers=["lm_head"]))
    with pytest.raises(TypeError, match=r"store_options= must be a gradtrace.options.StoreOptions, got dict"):
        gradtrace.collect(model, batches, store_options={"dtype": "int8"})


def test_a_setting_the_entry_point_fixes_must_stay_at_its_default():
    model, batches = _model(), _lm_batches()
    with pytest.raises(ValueError, match=r"collect\(\) sets reduction itself"):
        gradtrace.collect(model, batches, options=CaptureOptions(reduction="mean"))
    from gradtrace.integrations.hf import GradtraceCallback

    with pytest.raises(ValueError, match=r"GradtraceCallback\(\) sets shard_bytes itself"):
        GradtraceCallback("unused", store_options=StoreOptions(shard_bytes=1 << 20))


def test_options_are_validated_with_the_keyword_messages():
    with pytest.raises(ValueError, match=r"reduction must be one of \('mean', 'sum', 'token_mean'\), got 'avg'"):
        CaptureOptions(reduction="avg")
    with pytest.raises(ValueError, match="contradict"):
        StoreOptions(resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"kind must be one of \('kfac', 'ekfac', 'fisher'\)"):
        FitOptions(kind="kfc")
    spec = gradtrace.LoGra(rank=2).to_dict()
    assert CaptureOptions(projection=spec).projection.to_dict() == spec  # a store's dict form is accepted


def test_capture_resolves_both_spellings_to_one_object():
    model = _model()
    by_keyword = gradtrace.Capture(model, reduction="token_mean", layers=["lm_head"], strict=True)
    by_options = gradtrace.Capture(model, options=CaptureOptions(reduction="token_mean", layers=["lm_head"],
                                                                 strict=True))
    assert by_keyword.options == by_options.options
    assert by_options.convention == by_keyword.convention and by_options.strict
    assert gradtrace.Capture(model).options == gradtrace.Capture(model, options=CaptureOptions()).options
    assert gradtrace.Capture(model).options.reduction == "mean" and gradtrace.Capture(model).options.loss_scale == 1.0


def test_fit_curvature_takes_and_records_fit_options():
    model, batches = _model(), _lm_batches(n=8)
    data = [{"input_ids": b["input_ids"]} for b in batches]
    by_keyword = fit_curvature(model, data, kind="kfac", damping=0.3, layers=["lm_head"])
    by_options = fit_curvature(model, data, options=CaptureOptions(layers=["lm_head"]),
                               fit_options=FitOptions(kind="kfac", damping=0.3))
    recorded = by_options.meta["gradtrace"]["options"]
    assert recorded == by_keyword.meta["gradtrace"]["options"]
    assert recorded["fit"] == record(FitOptions(kind="kfac", damping=0.3))
    assert by_options.kind == "kfac" and by_options.damping == 0.3
    for name, block in by_keyword.blocks.items():
        assert torch.equal(block.eigenvalues, by_options.blocks[name].eigenvalues)
