"""GradtraceCallback in a Hugging Face Trainer: captured per-example gradients equal brute force."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import Trainer

import gradtrace
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions, Loss, StoreOptions
from tests import tiny
from tests.integrations.common import (
    WeightRecorder,
    assert_rows_close,
    causal_loss,
    lm_rows,
    pad_collate,
    reference_rows,
    training_args,
)

MODELS = {"gpt2": lambda: tiny.gpt2(tied=True), "llama": lambda: tiny.llama()}


def _train(tmp_path, model, callback, rows=None, **overrides):
    rows = rows if rows is not None else lm_rows(12)
    recorder = WeightRecorder()
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "out"), **overrides),
                      train_dataset=Dataset.from_list(rows), data_collator=pad_collate,
                      callbacks=[recorder, callback])
    trainer.train()
    return trainer, recorder


@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=4, vector_rank=3, seed=1)], ids=["exact", "logra"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_trainer_gradients_equal_brute_force(tmp_path, arch, projection):
    """3 optimizer steps of 2 micro-batches of 2 (num_items_in_batch path): every row is the gradient of its
    example's summed token loss at the weights of its step."""
    rows = lm_rows(12)
    model = MODELS[arch]()
    callback = GradtraceCallback(tmp_path / "store", options=CaptureOptions(projection=projection))
    trainer, recorder = _train(tmp_path, model, callback, rows)
    store = callback.result()
    assert len(store) == 12 and sorted(store.ids, key=int) == [str(i) for i in range(12)]
    assert store.field("step") == sorted(store.field("step")) and set(store.field("step")) == {0, 1, 2}
    assert store.field("epoch") == [0] * 12
    lrs = {s: lr for s, lr in zip(store.field("step"), store.field("lr"))}
    assert lrs[0] == pytest.approx(5e-2) and lrs[1] == pytest.approx(5e-2 * 2 / 3) and lrs[2] < lrs[1]
    config = store.manifest["config"]["trainer"]
    assert config["ids"] == {"source": "index"} and config["check"]["loss_ratio"] == pytest.approx(1, abs=1e-5)
    assert config["loss"]["rules"] == ["sum / num_items_in_batch"]
    examples = {str(i): r for i, r in enumerate(rows)}
    got, want = reference_rows(trainer.model, store, recorder.states, examples, causal_loss, projection)
    assert_rows_close(store, got, want)
    # the Trainer is left as it was
    assert "compute_loss" not in vars(trainer) and "gradtrace_id" not in trainer.train_dataset.column_names
    assert not trainer.model._forward_pre_hooks and not trainer.model._forward_hooks


class _Classifier(torch.nn.Module):
    """A model that does not take loss kwargs: its loss is the micro-batch mean, divided by the accumulation
    steps by the Trainer (the last step of the epoch has fewer micro-batches)."""

    def __init__(self):
        super().__init__()
        self.net = tiny.MLP()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_model_without_loss_kwargs_and_a_partial_accumulation_step(tmp_path):
    generator = torch.Generator().manual_seed(3)
    rows = [{"x": torch.randn(7, generator=generator), "labels": int(i % 4)} for i in range(10)]
    model = _Classifier()
    callback = GradtraceCallback(tmp_path / "store")
    recorder = WeightRecorder()
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "out"), max_steps=-1, num_train_epochs=1),
                      train_dataset=rows, callbacks=[recorder, callback])
    assert not trainer.model_accepts_loss_kwargs
    trainer.train()
    store = callback.result()
    assert len(store) == 10 and set(store.field("step")) == {0, 1, 2}  # micro-batches 2 + 2 + 1
    assert store.manifest["config"]["trainer"]["loss"]["rules"] == ["micro-batch token mean / accumulation steps"]

    def loss(model, example):
        return torch.nn.functional.cross_entropy(model.net(example["x"][None]), torch.tensor([example["labels"]]))

    got, want = reference_rows(trainer.model, store, recorder.states, {str(i): r for i, r in enumerate(rows)}, loss)
    assert_rows_close(store, got, want)


def test_bf16_autocast(tmp_path):
    rows = lm_rows(8)
    callback = GradtraceCallback(tmp_path / "store")
    trainer, recorder = _train(tmp_path, tiny.llama(), callback, rows, bf16=True, max_steps=2)
    store = callback.result()
    assert store.manifest["config"]["trainer"]["loss"]["mixed_precision"] == "bf16"
    got, want = reference_rows(trainer.model, store, recorder.states, {str(i): r for i, r in enumerate(rows)},
                               causal_loss, autocast=torch.bfloat16)
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(rel.max()) < 3e-2, rel


def test_id_column_trajectory_every_and_epochs(tmp_path):
    """ids from a column, every other step, two epochs, one row per (example, step) with DVEmb's fields."""
    rows = lm_rows(8, seed=1)
    projection = gradtrace.LoGra(rank=2, vector_rank=2)
    callback = GradtraceCallback(tmp_path / "store", ids="id", every=2, trajectory=True,
                                 options=CaptureOptions(projection=projection))
    trainer, recorder = _train(tmp_path, tiny.gpt2(), callback, rows, gradient_accumulation_steps=1, max_steps=-1,
                               num_train_epochs=2)
    store = callback.result()
    steps, examples = store.field("step"), store.field("example")
    assert set(steps) == {0, 2, 4, 6} and set(store.field("epoch")) == {0, 1}
    assert store.ids == [f"{e}@{s}" for e, s in zip(examples, steps)]
    assert all(e.startswith("doc-") for e in examples)  # ids are the column's
    by_id = {r["id"]: r for r in rows}
    shift = 1 if trainer._loss_shifts_labels else 0  # how this Trainer counts num_items_in_batch
    for step in set(steps):  # weight = lr / num_items_in_batch (GA 1: the step's target tokens)
        members = [i for i, s in enumerate(steps) if s == step]
        targets = sum(len(by_id[examples[i]]["input_ids"]) - shift for i in members)
        for i in members:
            assert store.field("weight")[i] == pytest.approx(store.field("lr")[i] / targets, rel=1e-6)
    got, want = reference_rows(trainer.model, store, recorder.states, by_id, causal_loss, projection)
    assert_rows_close(store, got, want)
    embeddings = gradtrace.data_value_embeddings(store)
    assert len(embeddings) == len(set(examples))


def test_checkpoints_are_recorded_in_the_store(tmp_path):
    """Also: evaluation between steps (its batches carry no ids and run without capture)."""
    callback = GradtraceCallback(tmp_path / "store", options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    model = tiny.gpt2()
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "out"), save_strategy="steps", save_steps=1,
                                                      lr_scheduler_type="constant", eval_strategy="steps",
                                                      eval_steps=2, per_device_eval_batch_size=2),
                      train_dataset=Dataset.from_list(lm_rows(12)), eval_dataset=Dataset.from_list(lm_rows(4, seed=5)),
                      data_collator=pad_collate, callbacks=[callback])
    trainer.train()
    assert "eval_loss" in trainer.evaluate()  # after training: the model sees no ids either
    store = callback.result()
    assert len(store) == 12
    from gradtrace.integrations.hf import checkpoints

    saved = checkpoints(tmp_path / "store")
    assert [c["step"] for c in saved] == [1, 2, 3]
    for c in saved:
        assert (tmp_path / "out" / f"checkpoint-{c['step']}").is_dir() and c["path"].endswith(f"checkpoint-{c['step']}")
        assert c["lr"] == pytest.approx(5e-2) and c["mean_lr"] == pytest.approx(5e-2) and c["updates"] == 1

    # what the records are for: TracIn over the saved checkpoints, LESS from a checkpoint's optimizer state
    from transformers import GPT2LMHeadModel

    from gradtrace.fit.methods.less import less_features
    from gradtrace.projection.sketch import DenseProjection

    batch = {"id": [f"t{i}" for i in range(4)], **pad_collate(lm_rows(4, seed=9))}
    logra = gradtrace.LoGra(rank=2)
    train_sets, query_sets = [], []
    for c in saved[1:]:
        at = GPT2LMHeadModel.from_pretrained(c["path"])
        train_sets.append(gradtrace.collect(at, [batch], options=CaptureOptions(projection=logra)))
        query_sets.append(gradtrace.collect(at, [{**batch, "id": ["q0", "q1", "q2", "q3"]}],
                                            options=CaptureOptions(projection=logra)))
    scores = gradtrace.Attributor("tracin", train_sets, weights=[c["mean_lr"] for c in saved[1:]]).score(
        query_sets, matrix=True)
    assert scores.matrix.shape == (4, 4)
    last = saved[-1]
    state = torch.load(f"{last['path']}/optimizer.pt", weights_only=True)
    names = store.manifest["config"]["trainer"]["optimizer_parameters"]
    named, start = {**state, "param_groups": []}, 0  # a state dict naming its parameters, as torch records them
    for group in state["param_groups"]:
        named["param_groups"].append({**group, "param_names": names[start:start + len(group["params"])]})
        start += len(group["params"])
    features = less_features(GPT2LMHeadModel.from_pretrained(last["path"]), named, [batch],
                             options=CaptureOptions(layers=["transformer.h.0.mlp.*"], projection=DenseProjection(8)))
    assert features.read(0, 4).shape == (4, 8)

    # TrackStar over the saved checkpoints, an ensemble: each member reads its own checkpoint's optimizer.pt (the
    # Trainer's weight-decay groups: matched to the model by the names each entry carries into its store)
    assert all(c["optimizer_parameters"] == names for c in saved) and len(state["param_groups"]) == 2
    layers = ["transformer.h.*.mlp.*"]
    stores = gradtrace.collect_checkpoints(saved, [batch], out=tmp_path / "members",
                                           options=CaptureOptions(layers=layers))
    assert all(s.manifest["config"]["checkpoint"]["optimizer_parameters"] == names for s in stores)
    queries = gradtrace.collect_checkpoints(saved, [{**batch, "id": ["q0", "q1", "q2", "q3"]}],
                                            options=CaptureOptions(layers=layers))
    ensemble = gradtrace.Ensemble("trackstar", stores).fit(GPT2LMHeadModel.from_pretrained(saved[0]["path"]),
                                                           checkpoints=saved)
    got = ensemble.score(queries, matrix=True).matrix.double()
    want, bound = 0, 0
    eps, dim = torch.finfo(torch.float32).eps, stores[0].spec.dim
    for c, store, query in zip(saved, stores, queries):  # each member alone, its optimizer state given by hand
        at = GPT2LMHeadModel.from_pretrained(c["path"])
        single = gradtrace.Attributor("trackstar", store).fit(at, optimizer=torch.load(
            f"{c['path']}/optimizer.pt", weights_only=True), param_names=names).score(query, matrix=True).matrix
        factor = 1 / (3 * float(single.double().abs().mean()))
        want = want + factor * single.double()
        bound = bound + factor * (dim * eps + 3 * eps * single.double().abs())  # cosines of unit rows, then the sum
    assert bool(((got - want).abs() <= 2 * bound).all())
    # unrolled over the same checkpoints: the run's segments, each directory's optimizer.pt mapped by the names its
    # store records -- the same numbers as every state and name given by hand
    from gradtrace.integrations.hf import segments

    steps, lr = segments(tmp_path / "store")
    assert steps == [1, 1, 1] and lr == pytest.approx([5e-2] * 3)
    first = GPT2LMHeadModel.from_pretrained(saved[0]["path"])
    read = gradtrace.Unrolled("kfac", stores, steps=steps, lr=lr).fit(first, [batch], checkpoints=saved)
    members = [GPT2LMHeadModel.from_pretrained(c["path"]) for c in saved]
    given = gradtrace.Unrolled("kfac", stores, steps=steps, lr=lr).fit(
        None, [batch], models=members, param_names=[names] * 3,
        optimizers=[torch.load(f"{c['path']}/optimizer.pt", weights_only=True) for c in saved])
    assert read.scales == given.scales and all(s > 0 for scales in read.scales for s in scales.values())
    assert torch.equal(read.score(queries[-1], matrix=True).matrix, given.score(queries[-1], matrix=True).matrix)
    # the callback saves the names beside every optimizer.pt, so a checkpoint directory maps its grouped state alone:
    # a store collected without the run's records (plain gradtrace.collect) scores as with the names given by hand
    import json
    import shutil
    from pathlib import Path

    from gradtrace.common.checkpoints import OPTIMIZER_NAMES_FILE
    from gradtrace.common.errors import UsageError

    for c in saved:
        beside = json.loads((Path(c["path"]) / OPTIMIZER_NAMES_FILE).read_text())
        assert beside == {"optimizer_parameters": names, "step": c["step"]}
    first = GPT2LMHeadModel.from_pretrained(saved[0]["path"])
    plain = gradtrace.collect(first, [batch], options=CaptureOptions(layers=layers))
    from_dir = gradtrace.Attributor("trackstar", plain).fit(first, optimizer=saved[0]["path"])
    by_hand = gradtrace.Attributor("trackstar", plain).fit(first, optimizer=torch.load(
        f"{saved[0]['path']}/optimizer.pt", weights_only=True), param_names=names)
    assert torch.equal(from_dir.score(queries[0], matrix=True).matrix, by_hand.score(queries[0], matrix=True).matrix)
    path_store = gradtrace.collect_checkpoints([saved[0]["path"]], [batch], out=tmp_path / "by_path",
                                               options=CaptureOptions(layers=layers))
    assert path_store[0].manifest["config"]["checkpoint"]["optimizer_parameters"] == names
    # without the names (a checkpoint saved without the callback) a grouped state is refused, not guessed
    bare_dir = tmp_path / "bare-checkpoint"
    shutil.copytree(saved[0]["path"], bare_dir)
    (bare_dir / OPTIMIZER_NAMES_FILE).unlink()
    bare = gradtrace.collect_checkpoints([bare_dir], [batch], out=tmp_path / "bare",
                                         options=CaptureOptions(layers=layers))
    with pytest.raises(ValueError, match="2 parameter groups and records no parameter names"):
        gradtrace.Attributor("trackstar", bare[0]).fit(first, optimizer=bare_dir)
    (bare_dir / OPTIMIZER_NAMES_FILE).write_text("{not json")
    with pytest.raises(UsageError, match=r"gradtrace-optimizer\.json is not readable .*param_names="):
        gradtrace.Attributor("trackstar", bare[0]).fit(first, optimizer=bare_dir)


def test_custom_compute_loss_is_refused(tmp_path):
    class Doubled(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    model = tiny.gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = GradtraceCallback(tmp_path / "store")
    trainer = Doubled(model=model, args=training_args(str(tmp_path / "out")),
                      train_dataset=Dataset.from_list(lm_rows(8)), data_collator=pad_collate, callbacks=[callback])
    with pytest.raises(ValueError, match=r"loss is 2x what GradtraceCallback derived"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any update
    assert not (tmp_path / "store" / "manifest.json").exists()
    assert not model._forward_pre_hooks and "compute_loss" not in vars(trainer)
    # stating the convention (here: the token mean of num_items_in_batch, doubled) makes it work
    callback = GradtraceCallback(tmp_path / "store2", loss=Loss(reduction="token_mean", scale=2.0))
    trainer = Doubled(model=tiny.gpt2(), args=training_args(str(tmp_path / "out")),
                      train_dataset=Dataset.from_list(lm_rows(8)), data_collator=pad_collate, callbacks=[callback])
    trainer.train()
    assert len(callback.result()) == 8


def test_model_it_cannot_capture_fails_at_train_begin(tmp_path):
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, labels=None):
            out = self.attn(x, x, x)[0].mean(dim=(1, 2))
            return {"loss": ((out - labels) ** 2).mean()}

    rows = [{"x": torch.randn(3, 8), "labels": 0.5} for _ in range(4)]
    callback = GradtraceCallback(tmp_path / "store")
    recorder = WeightRecorder()
    trainer = Trainer(model=Attention(), args=training_args(str(tmp_path / "out")), train_dataset=rows,
                      callbacks=[recorder, callback])
    with pytest.raises(ValueError, match=r"no capturable layer selected in Attention \(attn \(MultiheadAttention\)"):
        trainer.train()
    assert recorder.states == {}  # before the first step
    assert not trainer.model._forward_pre_hooks and "compute_loss" not in vars(trainer)


def test_uncapturable_trainable_layer_fails_at_train_begin_unless_partial(tmp_path):
    """Coverage is never silent: a trainable layer no rule captures stops train() before the first step, naming the
    fix; with CaptureOptions(partial=True) training runs and the store records the share captured."""

    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 4)
            self.grouped = torch.nn.Conv1d(4, 4, 1, groups=2)

        def forward(self, x, labels=None):
            out = self.grouped(self.inp(x).transpose(1, 2)).mean(dim=(1, 2))
            return {"loss": ((out - labels) ** 2).mean()}

    rows = [{"x": torch.randn(3, 8), "labels": 0.5} for _ in range(4)]
    recorder = WeightRecorder()
    trainer = Trainer(model=Grouped(), args=training_args(str(tmp_path / "out")), train_dataset=rows,
                      callbacks=[recorder, GradtraceCallback(tmp_path / "store")])
    with pytest.raises(ValueError, match=r"grouped\.weight, grouped\.bias in grouped .*exclude=\['grouped'\]"):
        trainer.train()
    assert recorder.states == {}  # before the first step
    assert not trainer.model._forward_pre_hooks
    model = Grouped()
    callback = GradtraceCallback(tmp_path / "partial", options=CaptureOptions(partial=True))
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "out2"), max_steps=1), train_dataset=rows,
                      callbacks=[callback])
    with pytest.warns(UserWarning, match="grouped"):
        trainer.train()
    coverage = callback.result().manifest["config"]["gradtrace"]["coverage"]
    assert coverage["share"] == 36 / 48 and coverage["partial"] and coverage["left_out_by_reason"] == {"unsupported": 2}


def test_store_another_run_is_writing_fails_at_train_begin(tmp_path):
    import json
    import socket
    import subprocess

    store = tmp_path / "store"
    store.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        (store / "rank-00000.lock").write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
        callback = GradtraceCallback(store, store_options=StoreOptions(overwrite=True))
        recorder = WeightRecorder()
        trainer = Trainer(model=tiny.gpt2(), args=training_args(str(tmp_path / "out")),
                          train_dataset=Dataset.from_list(lm_rows(8)), data_collator=pad_collate,
                          callbacks=[recorder, callback])
        with pytest.raises(gradtrace.store.StoreError, match=rf"being written by another run \(pid {other.pid}"):
            trainer.train()
        assert recorder.states == {}
    finally:
        other.kill()
        other.wait()


def test_error_during_training_closes_the_capture_and_the_store(tmp_path):
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    callback = GradtraceCallback(tmp_path / "store", options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    trainer = Trainer(model=tiny.gpt2(), args=training_args(str(tmp_path / "out")),
                      train_dataset=Dataset.from_list(lm_rows(12)), data_collator=pad_collate,
                      callbacks=[callback, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    with pytest.raises(gradtrace.store.StoreError, match="interrupted"):
        gradtrace.GradientStore.open(tmp_path / "store")
    partial = gradtrace.GradientStore.open(tmp_path / "store", allow_incomplete=True)
    assert len(partial) == 8 and set(partial.field("step")) == {0, 1}
    assert not trainer.model._forward_pre_hooks and not trainer.model._forward_hooks
    assert "compute_loss" not in vars(trainer) and "gradtrace_id" not in trainer.train_dataset.column_names
    assert not (tmp_path / "store" / "rank-00000.lock").exists()


def test_callback_added_after_construction_needs_attach(tmp_path):
    trainer = Trainer(model=tiny.gpt2(), args=training_args(str(tmp_path / "out"), max_steps=1),
                      train_dataset=Dataset.from_list(lm_rows(4)), data_collator=pad_collate)
    callback = GradtraceCallback(tmp_path / "store")
    trainer.add_callback(callback)
    with pytest.raises(RuntimeError, match=r"not attached[\s\S]*callback.attach\(trainer\)"):
        trainer.train()
    callback.attach(trainer)
    trainer.train()
    assert len(callback.result()) == 4


def test_content_hash_ids_across_epochs(tmp_path):
    """ids=None: each example is identified by its tokens; a new epoch sees the same examples again."""
    from gradtrace.capture.context import content_hash

    rows = lm_rows(8, seed=2)
    callback = GradtraceCallback(tmp_path / "store", ids=None,
                                 options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    _train(tmp_path, tiny.gpt2(), callback, rows, gradient_accumulation_steps=1, max_steps=-1, num_train_epochs=2)
    store = callback.result()
    import numpy as np

    assert sorted(store.ids) == sorted(content_hash(np.asarray(r["input_ids"], dtype=np.int64)) for r in rows)
    assert set(store.field("epoch")) == {0}  # the second epoch's uses are the same examples: not stored again
    assert store.manifest["config"]["trainer"]["ids"] == {"source": "content-hash"}


def test_missing_id_column_is_reported_before_training(tmp_path):
    trainer = Trainer(model=tiny.gpt2(), args=training_args(str(tmp_path / "out")),
                      train_dataset=Dataset.from_list(lm_rows(4)), data_collator=pad_collate,
                      callbacks=[GradtraceCallback(tmp_path / "store", ids="uid")])
    with pytest.raises(ValueError, match=r"ids='uid': the training dataset has no such column \(columns: \['id', "):
        trainer.train()
    assert "compute_loss" not in vars(trainer) and "gradtrace_id" not in trainer.train_dataset.column_names
