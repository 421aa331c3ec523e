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


# -- the LESS and trajectory writers take the same objects ------------------------------------------------------------
def _mlp_batches(n: int = 7, size: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 7, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n, size)]


def _adam_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = tiny.MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for xb, yb in _mlp_batches(12, 6):
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_less_features_keyword_and_options_spellings_write_identical_stores(tmp_path):
    from gradtrace.methods.less import less_features, less_query_features
    from gradtrace.projection.sketch import DenseProjection

    model, optimizer = _adam_mlp()
    sketch, ids = DenseProjection(16, seed=2), [f"t{i}" for i in range(7)]
    by_keyword = less_features(model, optimizer, _mlp_batches(), projection=sketch, layers=["net.3"],
                               example_loss="sum", store=tmp_path / "kw", dtype="bfloat16", shard_rows=2, ids=ids)
    capture, store = CaptureOptions(layers=["net.3"]), StoreOptions(dtype="bfloat16", shard_rows=2)
    by_options = less_features(model, optimizer, _mlp_batches(), projection=sketch, store=tmp_path / "opt",
                               options=capture, store_options=store, ids=ids)
    assert by_keyword.ids == by_options.ids == ids
    assert torch.equal(by_keyword.read(0, 7), by_options.read(0, 7)) and by_keyword.spec == by_options.spec
    recorded = by_options.manifest["config"]["gradtrace"]["options"]
    assert recorded == by_keyword.manifest["config"]["gradtrace"]["options"]
    assert recorded == {"capture": record(capture), "store": record(store)}
    # in memory: the same rows as the store (bfloat16 there), keyword or object
    queries = less_query_features(model, _mlp_batches(), projection=sketch, layers=["net.3"], example_loss="sum")
    again = less_query_features(model, _mlp_batches(), projection=sketch, options=capture)
    assert torch.equal(queries.vectors, again.vectors) and queries.spec == again.spec


def test_less_features_refuse_a_setting_given_twice_or_one_they_fix(tmp_path):
    from gradtrace.methods.less import less_features, less_query_features
    from gradtrace.projection.sketch import DenseProjection

    model, optimizer = _adam_mlp()
    sketch = DenseProjection(8, seed=0)
    with pytest.raises(ValueError, match=r"less_features\(\): layers given both as a keyword argument and in options="):
        less_features(model, optimizer, _mlp_batches(), projection=sketch, layers=["net.3"],
                      options=CaptureOptions(layers=["net.3"]))
    with pytest.raises(ValueError, match=r"less_query_features\(\): dtype given both"):
        less_query_features(model, _mlp_batches(), projection=sketch, store=tmp_path / "q", dtype="int8",
                            store_options=StoreOptions())
    # LESS captures exact gradients of each example's own loss: its projection is the sketch, never a LoGra spec
    with pytest.raises(ValueError, match=r"less_query_features\(\) sets projection itself"):
        less_query_features(model, _mlp_batches(), projection=sketch,
                            options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(ValueError, match=r"less_features\(\) sets reduction itself"):
        less_features(model, optimizer, _mlp_batches(), projection=sketch, options=CaptureOptions(reduction="mean"))
    assert not (tmp_path / "q").exists()  # refused before anything was written


def _record_trajectory(writer, model, optimizer, capture_options: CaptureOptions) -> None:
    with gradtrace.capture(model, options=capture_options, callbacks=[writer]) as cap:
        for step, (xb, yb) in enumerate(_mlp_batches(6, 3)):
            cap.annotate(ids=[f"ex{3 * step + i}" for i in range(len(xb))])
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_trajectory_writer_keyword_and_options_spellings_write_identical_stores(tmp_path):
    from gradtrace.train.trajectory import TrajectoryWriter

    capture = CaptureOptions(reduction="mean", projection=gradtrace.LoGra(rank=2))
    stores = {}
    for name, kwargs in {"kw": {"dtype": "bfloat16", "shard_rows": 2},
                         "opt": {"store_options": StoreOptions(dtype="bfloat16", shard_rows=2)}}.items():
        torch.manual_seed(0)
        model = tiny.MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        writer = TrajectoryWriter(tmp_path / name, optimizer, **kwargs)
        _record_trajectory(writer, model, optimizer, capture)
        stores[name] = writer.result()
    kw, opt = stores["kw"], stores["opt"]
    assert kw.ids == opt.ids == ["ex0@0", "ex1@0", "ex2@0", "ex3@1", "ex4@1", "ex5@1"]
    assert torch.equal(kw.read(0, 6), opt.read(0, 6)) and kw.field("weight") == opt.field("weight")
    recorded = opt.manifest["config"]["gradtrace"]["options"]
    assert recorded == kw.manifest["config"]["gradtrace"]["options"]
    # the capture's resolved object: reduction and loss scale as the capture resolved them
    assert recorded == {"capture": record(gradtrace.Capture(tiny.MLP(), options=capture).options),
                        "store": record(StoreOptions(dtype="bfloat16", shard_rows=2, shard_bytes=None))}
    assert recorded["capture"]["loss_scale"] == 1.0
    assert recorded["capture"]["projection"] == gradtrace.LoGra(rank=2).to_dict()
    assert opt.manifest["config"]["trajectory"] == {"optimizer": "SGD", "start_step": 0}


def test_trajectory_writer_refuses_a_setting_given_twice_or_one_it_fixes(tmp_path):
    from gradtrace.train.trajectory import TrajectoryWriter

    optimizer = torch.optim.SGD(tiny.MLP().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"TrajectoryWriter\(\): shard_rows given both as a keyword argument and in "
                                         r"store_options="):
        TrajectoryWriter(tmp_path / "t", optimizer, shard_rows=8, store_options=StoreOptions(shard_rows=8))
    with pytest.raises(ValueError, match=r"TrajectoryWriter\(\) sets shard_bytes itself"):
        TrajectoryWriter(tmp_path / "t", optimizer, store_options=StoreOptions(shard_bytes=1 << 20))
    with pytest.raises(ValueError, match="resume/overwrite apply to a store"):
        TrajectoryWriter(None, optimizer, store_options=StoreOptions(resume=True))


def test_scores_record_what_produced_them_and_keep_it_through_save_and_load(tmp_path):
    gen = torch.Generator().manual_seed(0)
    spec = gradtrace.store.GradientSpec(params=[("w", 5)], projection=None,
                                        convention={"reduction": "sum", "example_loss": "sum"})
    train = [gradtrace.GradientSet(torch.randn(6, 5, generator=gen), [f"t{i}" for i in range(6)], spec)
             for _ in range(2)]
    queries = [gradtrace.GradientSet(torch.randn(2, 5, generator=gen), ["q0", "q1"], spec) for _ in range(2)]
    scores = gradtrace.Attributor("tracin", train, weights=[0.5, 0.25], block_rows=4).score(queries, topk=3,
                                                                                              matrix=True)
    want = 0.5 * queries[0].vectors @ train[0].vectors.t() + 0.25 * queries[1].vectors @ train[1].vectors.t()
    # two weighted 5-term float32 dot products per score: a few float32 eps (1.2e-7) of their size, 1e-5 bounds it
    torch.testing.assert_close(scores.matrix, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    recorded = {"method": "tracin", "method_options": scores.meta["options"], "checkpoint_weights": [0.5, 0.25],
                "topk": 3, "matrix": True, "block_rows": 4, "device": "cpu"}
    assert scores.meta["gradtrace"]["options"] == {"score": recorded}
    assert scores.meta["options"]["weights"] == [0.5, 0.25]  # the fields older readers use are unchanged
    assert scores.meta["method"] == "tracin" and scores.meta["checkpoints"] == 2 and scores.meta["spec"]["dim"] == 5
    scores.save(tmp_path / "scores")
    assert gradtrace.Scores.load(tmp_path / "scores").meta["gradtrace"]["options"] == {"score": recorded}
    streamed = gradtrace.Attributor("grad_dot", train[0]).score(queries[0], topk=2, matrix=False)
    assert streamed.meta["gradtrace"]["options"]["score"] | {"method_options": None} == {
        "method": "grad_dot", "method_options": None, "checkpoint_weights": [1.0], "topk": 2, "matrix": False,
        "block_rows": gradtrace.Attributor("grad_dot", train[0]).block_rows, "device": "cpu"}
