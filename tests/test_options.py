"""Typed option objects (gradtrace.options) are the only way to configure an entry point: a setting is given once, in
its object; one the entry point fixes is refused; artifacts record the resolved objects."""

from __future__ import annotations

import pytest
import torch

import gradtrace
from gradtrace.fit.curvature import fit_curvature
from gradtrace.options import CaptureOptions, FitOptions, Loss, RunOptions, StoreOptions, record
from tests import tiny


def _lm_batches(n: int = 12, t: int = 8, batch: int = 4) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(1, tiny.VOCAB, (n, t), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + batch], "id": [f"e{j}" for j in range(i, i + batch)]} for i in range(0, n, batch)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny.gpt2(tied=True)


def test_collect_records_the_objects_that_configured_it(tmp_path):
    model, batches = _model(), _lm_batches()
    projection = gradtrace.LoGra(rank=4, seed=3)
    capture = CaptureOptions(projection=projection, layers=["*.mlp.*", "lm_head"])
    store = gradtrace.collect(model, batches, store=tmp_path / "s", options=capture,
                              store_options=StoreOptions(dtype="bfloat16", shard_rows=5, config={"mine": 1}))
    in_memory = gradtrace.collect(model, batches, options=capture)
    assert store.ids == in_memory.ids == [f"e{i}" for i in range(12)]
    # bfloat16 keeps 8 significant bits: each stored value within 2^-8 of the float32 one
    torch.testing.assert_close(store.read(0, 12), in_memory.vectors, rtol=2 ** -8, atol=0)
    recorded = store.manifest["config"]["gradtrace"]["options"]
    assert recorded["store"] == {"dtype": "bfloat16", "resume": False, "overwrite": False, "shard_bytes": None,
                                 "shard_rows": 5, "queue_size": 8}  # the user's config is beside it, not in it
    assert store.manifest["config"]["mine"] == 1
    assert recorded["capture"]["projection"] == projection.to_dict()
    assert recorded == {"capture": record(capture), "store": record(StoreOptions(dtype="bfloat16", shard_rows=5)),
                        "loss": record(Loss())}


def test_settings_are_given_one_way_only(tmp_path):
    model, batches = _model(), _lm_batches()
    with pytest.raises(TypeError, match="unexpected keyword argument 'dtype'"):
        gradtrace.collect(model, batches, store=tmp_path / "s", dtype="int8")
    with pytest.raises(TypeError, match="unexpected keyword argument 'layers'"):
        gradtrace.capture(model, layers=["lm_head"])
    with pytest.raises(TypeError, match=r"store_options= must be a gradtrace.StoreOptions, got dict"):
        gradtrace.collect(model, batches, store_options={"dtype": "int8"})
    with pytest.raises(TypeError, match=r"loss must be a gradtrace.Loss, a callable"):
        gradtrace.collect(model, batches, "sum")
    assert not (tmp_path / "s").exists()


def test_a_loss_setting_the_entry_point_fixes_is_refused():
    model, batches = _model(), _lm_batches()
    with pytest.raises(ValueError, match=r"collect\(\) sums each example's loss .* leave Loss.reduction"):
        gradtrace.collect(model, batches, Loss(reduction="mean"))
    with pytest.raises(ValueError, match=r"capture\(\): the training loop computes the loss; leave Loss.fn None"):
        gradtrace.capture(model, Loss(fn=lambda m, b: m(b)))
    from gradtrace.integrations.hf import GradtraceCallback

    with pytest.raises(ValueError, match=r"Loss.scale states the Trainer's loss together with Loss.reduction"):
        GradtraceCallback("unused", loss=Loss(scale=2.0))


def test_options_are_validated_when_made():
    with pytest.raises(ValueError, match=r"reduction must be one of \('mean', 'sum', 'token_mean'\), got 'avg'"):
        Loss(reduction="avg")
    with pytest.raises(ValueError, match=r"scale must be a finite number other than 0"):
        Loss(scale=0.0)
    with pytest.raises(ValueError, match="contradict"):
        StoreOptions(resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"kind must be one of \('kfac', 'ekfac', 'fisher'\)"):
        FitOptions(kind="kfc")
    with pytest.raises(ValueError, match=r"model_dtype must be one of"):
        RunOptions(model_dtype="fp8")
    spec = gradtrace.LoGra(rank=2).to_dict()
    assert CaptureOptions(projection=spec).projection.to_dict() == spec  # a store's dict form is accepted
    assert Loss.of(None) == Loss() and Loss.of(tiny.lm_example_loss).fn is tiny.lm_example_loss


def test_a_shard_writer_refuses_a_dtype_other_than_its_specs(tmp_path):
    spec = gradtrace.store.GradientSpec(params=[("w", 3)], projection=None, dtype="bfloat16",
                                        convention={"reduction": "sum", "example_loss": "sum"})
    with pytest.raises(ValueError, match=r"StoreOptions\(dtype='int8'\) differs from the spec's dtype 'bfloat16'"):
        gradtrace.store.ShardWriter(tmp_path / "s", spec, StoreOptions(dtype="int8"))
    writer = gradtrace.store.ShardWriter(tmp_path / "s", spec, StoreOptions(shard_rows=2))  # None: the spec's
    writer.put(["a", "b", "c"], torch.tensor([[1.0, 2.0, 3.0]] * 3))
    writer.close()
    assert gradtrace.GradientStore.open(tmp_path / "s").spec.dtype == "bfloat16"


def test_capture_reads_the_loop_loss_from_one_object():
    model = _model()
    cap = gradtrace.Capture(model, Loss(reduction="token_mean", scale=0.5), options=CaptureOptions(partial=True))
    assert cap.convention.reduction == "token_mean" and cap.loss_scale == 0.5 and cap.partial
    default = gradtrace.Capture(model)
    assert default.loss.reduction == "mean" and default.loss.scale == 1.0 and default.options == CaptureOptions()
    assert default.causal_lm  # a *LMHeadModel: shifted labels unless Loss(causal_lm=False)
    assert not gradtrace.Capture(model, Loss(causal_lm=False)).causal_lm


def test_fit_curvature_takes_and_records_fit_options():
    model, batches = _model(), _lm_batches(n=8)
    data = [{"input_ids": b["input_ids"]} for b in batches]
    fitted = fit_curvature(model, data, options=CaptureOptions(layers=["lm_head"]),
                           fit_options=FitOptions(kind="kfac", damping=0.3))
    recorded = fitted.meta["gradtrace"]["options"]
    assert recorded["fit"] == record(FitOptions(kind="kfac", damping=0.3))
    assert recorded["capture"] == record(CaptureOptions(layers=["lm_head"])) and recorded["loss"] == record(Loss())
    assert fitted.kind == "kfac" and fitted.damping == 0.3
    # the flat settings of a method's fit go to the same objects
    from gradtrace.fit.curvature.fit import fit_curvature_from

    again = fit_curvature_from(model, data, None, None, {"kind": "kfac", "damping": 0.3, "layers": ["lm_head"]})
    for name, block in fitted.blocks.items():
        assert torch.equal(block.eigenvalues, again.blocks[name].eigenvalues)
    with pytest.raises(TypeError, match=r"fit\(\): unknown setting 'dampng'"):
        fit_curvature_from(model, data, None, None, {"dampng": 0.3})


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


def test_less_features_in_a_store_equal_those_in_memory_and_record_their_objects(tmp_path):
    from gradtrace.fit.methods.less import less_features, less_query_features
    from gradtrace.projection.sketch import DenseProjection

    model, optimizer = _adam_mlp()
    sketch, ids = DenseProjection(16, seed=2), [f"t{i}" for i in range(7)]
    capture, store = CaptureOptions(layers=["net.3"], projection=sketch), StoreOptions(shard_rows=2)
    stored = less_features(model, optimizer, _mlp_batches(), store=tmp_path / "s", options=capture,
                           store_options=store, run=RunOptions(ids=ids))
    in_memory = less_features(model, optimizer, _mlp_batches(), options=capture, run=RunOptions(ids=ids))
    assert stored.ids == in_memory.ids == ids
    assert torch.equal(stored.read(0, 7), in_memory.vectors) and stored.spec == in_memory.spec
    recorded = stored.manifest["config"]["gradtrace"]["options"]
    assert recorded == {"capture": record(capture), "store": record(StoreOptions(dtype="float32", shard_rows=2)),
                        "loss": record(Loss(example_loss="mean"))}  # LESS's default: the per-token mean
    summed = less_query_features(model, _mlp_batches(), Loss(example_loss="sum"), options=capture)
    assert summed.spec.convention["example_loss"] == "sum"


def test_less_features_refuse_what_they_fix(tmp_path):
    from gradtrace.fit.methods.less import less_features, less_query_features
    from gradtrace.projection.sketch import DenseProjection

    model, optimizer = _adam_mlp()
    sketch = DenseProjection(8, seed=0)
    # LESS captures exact gradients of each example's own loss: its projection is the sketch, never a LoGra spec
    with pytest.raises(TypeError, match=r"got projection=LoGra \(LoGra projects each layer"):
        less_query_features(model, _mlp_batches(), store=tmp_path / "q",
                            options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(ValueError, match=r"leave Loss.reduction and Loss.scale unset"):
        less_features(model, optimizer, _mlp_batches(), Loss(reduction="mean"),
                      options=CaptureOptions(projection=sketch))
    with pytest.raises(TypeError, match=r"got projection=None"):
        less_features(model, optimizer, _mlp_batches(), options=CaptureOptions())
    # the sketch is LESS's alone: everything that projects per layer refuses it, before any gradient
    for run_it in (lambda o: gradtrace.collect(model, _mlp_batches(), options=o, store=tmp_path / "c"),
                   lambda o: gradtrace.capture(model, options=o),
                   lambda o: fit_curvature(model, _mlp_batches(), options=o)):
        with pytest.raises(ValueError, match=r"CaptureOptions.projection is a DenseProjection.*less_features"):
            run_it(CaptureOptions(projection=sketch))
    assert not (tmp_path / "c").exists()
    # recorded as its spec, and rebuilt from it
    assert record(CaptureOptions(projection=sketch))["projection"] == sketch.to_dict()
    rebuilt = CaptureOptions(projection=sketch.to_dict()).projection
    assert isinstance(rebuilt, DenseProjection) and rebuilt.to_dict() == sketch.to_dict()
    assert not (tmp_path / "q").exists()  # refused before anything was written


def _record_trajectory(writer, model, optimizer, capture_options: CaptureOptions) -> None:
    with gradtrace.capture(model, options=capture_options, callbacks=[writer]) as cap:
        for step, (xb, yb) in enumerate(_mlp_batches(6, 3)):
            cap.annotate(ids=[f"ex{3 * step + i}" for i in range(len(xb))])
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_trajectory_writer_records_its_store_and_capture_objects(tmp_path):
    from gradtrace.train.trajectory import TrajectoryWriter

    capture = CaptureOptions(projection=gradtrace.LoGra(rank=2))
    stores = {}
    for name, path in {"store": tmp_path / "t", "memory": None}.items():
        torch.manual_seed(0)
        model = tiny.MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        writer = TrajectoryWriter(path, optimizer, store_options=StoreOptions(dtype="bfloat16", shard_rows=2)
                                  if path is not None else None)
        _record_trajectory(writer, model, optimizer, capture)
        stores[name] = writer.result()
    store, memory = stores["store"], stores["memory"]
    assert store.ids == memory.ids == ["ex0@0", "ex1@0", "ex2@0", "ex3@1", "ex4@1", "ex5@1"]
    torch.testing.assert_close(store.read(0, 6), memory.vectors, rtol=2 ** -8, atol=0)  # bfloat16 on disk
    recorded = store.manifest["config"]["gradtrace"]["options"]
    assert recorded == {"capture": record(capture),
                        "store": record(StoreOptions(dtype="bfloat16", shard_rows=2))}
    assert store.manifest["config"]["trajectory"] == {"optimizer": "SGD", "start_step": 0}
    optimizer = torch.optim.SGD(tiny.MLP().parameters(), lr=0.1)
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
                "topk": 3, "matrix": True, "block_rows": 4, "device": "cpu", "score_dtype": "float32"}
    assert scores.meta["gradtrace"]["options"] == {"score": recorded}
    assert scores.meta["options"]["weights"] == [0.5, 0.25]  # the fields older readers use are unchanged
    assert scores.meta["method"] == "tracin" and scores.meta["checkpoints"] == 2 and scores.meta["spec"]["dim"] == 5
    scores.save(tmp_path / "scores")
    assert gradtrace.Scores.load(tmp_path / "scores").meta["gradtrace"]["options"] == {"score": recorded}
    streamed = gradtrace.Attributor("grad_dot", train[0]).score(queries[0], topk=2, matrix=False)
    assert streamed.meta["gradtrace"]["options"]["score"] | {"method_options": None} == {
        "method": "grad_dot", "method_options": None, "checkpoint_weights": [1.0], "topk": 2, "matrix": False,
        "block_rows": gradtrace.Attributor("grad_dot", train[0]).block_rows, "device": "cpu", "score_dtype": "float32"}
