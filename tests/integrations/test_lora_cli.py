"""LoRA end to end from the command line (issue #29): a PEFT adapter directory, or a LoRA Trainer's ``checkpoint-N``,
is a model for every command -- loaded on its base model with ``is_trainable=True``, so the adapter weights are the
captured ones, as during training -- and a store the ``GradtraceCallback`` wrote during LoRA training is scored
from the CLI with the same captured parameters. The advice given on the way (``trainer.save_model()``, a frozen
``PeftModel``) is followed and works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions
from gradtrace.options.data import BatchOptions
from tests import tiny
from tests.cli.conftest import error_line, flat, invoke
from tests.integrations.common import char_tokenizer, lm_rows, pad_collate, training_args

peft = pytest.importorskip("peft")

RANK = 4
COLLECT = ("--rank", RANK, "--batch-size", 5, "--no-progress")
TEXTS = ["the king speaks.", "fair is foul, and foul is fair.", "a horse! a horse!", "to be, or not to be?",
         "all the world's a stage.", "now is the winter of our discontent.", "out, damned spot!",
         "the lady doth protest too much.", "brevity is the soul of wit.", "what's done is done."]
QUERIES = ["fair is foul.", "a kingdom for a horse!", "the world is a stage."]
WARNING = "differ from those of the model"


def _base(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def _peft(base_dir: Path, adapter: Path, *, trainable: bool = True):
    """The Python API's loading: ``PeftModel.from_pretrained(base, adapter, is_trainable=...)``."""
    return peft.PeftModel.from_pretrained(_base(base_dir), str(adapter), is_trainable=trainable)


def _jsonl(path: Path, texts: list[str], prefix: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


class Run:
    """A LoRA Trainer run on a tiny Llama: its base model directory (with the tokenizer), output dir, callback
    store, ``checkpoint-2`` / ``checkpoint-4``, the trained adapter saved alone (``save_pretrained``: no tokenizer),
    and the data files."""

    def __init__(self, root: Path) -> None:
        from datasets import Dataset
        from transformers import Trainer

        self.root, self.base, self.out, self.store = root, root / "base", root / "out", root / "store"
        torch.manual_seed(0)
        tiny.llama(pad_token_id=0).save_pretrained(self.base)
        char_tokenizer().save_pretrained(self.base)
        lora = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, task_type="CAUSAL_LM",
                               target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
        self.model = peft.get_peft_model(_base(self.base), lora)  # adapter_config names self.base
        callback = GradtraceCallback(self.store, start_step=2,
                                     options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
        self.trainer = Trainer(model=self.model, args=training_args(str(self.out), max_steps=4, save_strategy="steps",
                                                                   save_steps=2),
                               train_dataset=Dataset.from_list(lm_rows(12)), data_collator=pad_collate,
                               processing_class=char_tokenizer(), callbacks=[callback])
        self.trainer.train()
        self.adapter = root / "adapter"
        self.model.save_pretrained(self.adapter)
        self.train = _jsonl(root / "train.jsonl", TEXTS, "t")
        self.queries = _jsonl(root / "queries.jsonl", QUERIES, "q")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def runner():
    from typer.testing import CliRunner

    return CliRunner()


def _batches(tokenizer_dir: Path, data: Path, batch_size: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return gradtrace.data.load(data, tokenizer, batch_options=BatchOptions(batch_size=batch_size))


def _max_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want|`` of a row over that row's norm (the reference's), over all rows."""
    assert got.shape == want.shape
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)).max())


def test_collect_an_adapter_dir_equals_the_python_api(run, runner, tmp_path):
    assert not (run.adapter / "config.json").exists() and not (run.adapter / "tokenizer.json").exists()
    invoke(runner, "collect", run.adapter, run.train, "--out", tmp_path / "store", *COLLECT)
    got = gradtrace.GradientStore.open(tmp_path / "store")
    names = [name for name, _ in got.spec.params]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)  # the adapters, the base is frozen
    # the Python API on PeftModel.from_pretrained(..., is_trainable=True), the tokenizer the base's; other batches
    # (3 rows, not 5: other padding), so the per-token sums run in another order: float32 rounding, ~1e-7 of a row
    model = _peft(run.base, run.adapter)
    want = gradtrace.collect(model, _batches(run.base, run.train, 3),
                             options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK, seed=0)))
    assert got.spec.params == want.spec.params and got.spec.model == want.spec.model
    assert got.ids == list(want.ids)
    error = _max_row_error(got.read(0, len(got)), want.vectors)
    assert error < 1e-5, error


def test_score_a_lora_training_store_from_the_cli(run, runner, tmp_path):
    # before the final model is saved: the advice is trainer.save_model() -- which, for LoRA, writes the adapter
    line = error_line(invoke(runner, "score", run.store, run.queries, "--out", tmp_path / "s0", "--no-progress",
                             code=2))
    assert "trainer.save_model()" in line
    run.trainer.save_model()
    assert (run.out / "adapter_config.json").exists() and not (run.out / "config.json").exists()
    result = invoke(runner, "score", run.store, run.queries, "--out", tmp_path / "s1", "--topk", 0, "--matrix", "yes",
                    "--no-progress")
    assert WARNING not in flat(result.output)  # the loaded adapter holds the weights the run ended with
    got = gradtrace.Scores.load(tmp_path / "s1")
    store = gradtrace.GradientStore.open(run.store)
    # the Python API: queries through PeftModel.from_pretrained(..., is_trainable=True) with the store's projection
    projection = gradtrace.projection.projection_from_dict(store.spec.projection)
    queries = gradtrace.collect(_peft(run.base, run.out), _batches(run.out, run.queries, 8),
                                options=CaptureOptions(projection=projection))
    store.spec.check_compatible(queries.spec)  # the captured parameters of training are those of the CLI's loading
    assert queries.spec.params == store.spec.params
    want = gradtrace.Attributor("grad_dot", store).score(queries)
    assert got.query_ids == want.query_ids and got.train_ids == want.train_ids
    # same query batches as the CLI (8 rows): the difference is the blocked engine's summation order only
    scale = float(want.matrix.abs().max())
    error = float((got.matrix - want.matrix).abs().max()) / scale
    assert error < 1e-5, error
    # a fit that takes a model (K-FAC on data) loads an adapter the same way: its factors bind to the store's params
    # (at checkpoint-2: the weights of the store's first rows, which a curvature is checked against)
    invoke(runner, "fit", run.store, run.train, "--method", "kfac", "--model", run.out / "checkpoint-2", "--out",
           tmp_path / "fit", "--no-progress")
    invoke(runner, "score", run.store, run.queries, "--method", "kfac", "--curvature", tmp_path / "fit", "--out",
           tmp_path / "s2", "--no-progress")


def test_a_frozen_peft_model_gets_advice_that_works(run):
    store = gradtrace.GradientStore.open(run.store)
    projection = gradtrace.projection.projection_from_dict(store.spec.projection)
    batches = list(_batches(run.base, run.queries, 8))
    with pytest.raises(ValueError, match="is_trainable=True") as err:  # PEFT's default loading: adapters frozen
        gradtrace.collect(_peft(run.base, run.adapter, trainable=False), batches,
                          options=CaptureOptions(projection=projection))
    assert "include_frozen" in str(err.value)  # named as what not to do: it adds the base's weights
    followed = gradtrace.collect(_peft(run.base, run.adapter, trainable=True), batches,
                                 options=CaptureOptions(projection=projection))
    store.spec.check_compatible(followed.spec)
    assert followed.spec.params == store.spec.params


def test_a_lora_trainer_checkpoint_is_a_model(run, runner, tmp_path):
    checkpoint = run.out / "checkpoint-2"
    assert (checkpoint / "adapter_config.json").exists() and (checkpoint / "tokenizer.json").exists()
    invoke(runner, "collect", checkpoint, run.train, "--out", tmp_path / "store", *COLLECT)
    collected = gradtrace.GradientStore.open(tmp_path / "store")
    assert collected.spec.model == gradtrace.store.model_fingerprint(_peft(run.base, checkpoint))
    # the training store scored at a checkpoint inside its captured steps: its weights, no warning
    result = invoke(runner, "score", run.store, run.queries, "--model", checkpoint, "--out", tmp_path / "scores",
                    "--topk", 0, "--matrix", "yes", "--no-progress")
    assert WARNING not in flat(result.output)
    got = gradtrace.Scores.load(tmp_path / "scores")
    store = gradtrace.GradientStore.open(run.store)
    projection = gradtrace.projection.projection_from_dict(store.spec.projection)
    queries = gradtrace.collect(_peft(run.base, checkpoint), _batches(checkpoint, run.queries, 8),
                                options=CaptureOptions(projection=projection))
    want = gradtrace.Attributor("grad_dot", store).score(queries)
    error = float((got.matrix - want.matrix).abs().max()) / float(want.matrix.abs().max())
    assert error < 1e-5, error


def _renamed_base(run: Run, target: Path, name: str) -> Path:
    """A copy of the adapter whose adapter_config.json names its base ``name``."""
    shutil.copytree(run.adapter, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": name}))
    return target


def test_base_model_option_and_a_missing_base(run, runner, tmp_path):
    hub = _renamed_base(run, tmp_path / "hub-adapter", "some-org/tiny-llama")  # a hub name: never downloaded
    line = error_line(invoke(runner, "collect", hub, run.train, "--out", tmp_path / "s0", *COLLECT, code=2))
    assert "'some-org/tiny-llama'" in line and "not a local model directory" in line and "--base-model DIR" in line
    assert not (tmp_path / "s0").exists()
    invoke(runner, "collect", hub, run.train, "--out", tmp_path / "s1", "--base-model", run.base, *COLLECT)
    first = gradtrace.GradientStore.open(tmp_path / "s1")
    assert first.spec.model == gradtrace.store.model_fingerprint(_peft(run.base, run.adapter))
    # the store records the base: score needs no --base-model (nor --model)
    invoke(runner, "score", tmp_path / "s1", run.queries, "--out", tmp_path / "scores", "--no-progress")
    # --base-model overrides the base adapter_config.json names: another base, other weights in the store
    torch.manual_seed(1)
    other = tmp_path / "other-base"
    tiny.llama(pad_token_id=0).save_pretrained(other)
    char_tokenizer().save_pretrained(other)  # the adapter has none: the base's is read
    invoke(runner, "collect", run.adapter, run.train, "--out", tmp_path / "s2", "--base-model", other, *COLLECT)
    second = gradtrace.GradientStore.open(tmp_path / "s2")
    assert second.spec.model == gradtrace.store.model_fingerprint(_peft(other, run.adapter))
    assert second.spec.model["weights"] != first.spec.model["weights"]
    # a base named relative to the adapter directory is found there
    near = _renamed_base(run, tmp_path / "near" / "adapter", "../../base-copy")
    shutil.copytree(run.base, tmp_path / "base-copy")
    invoke(runner, "collect", near, run.train, "--out", tmp_path / "s3", *COLLECT)
    assert torch.equal(gradtrace.GradientStore.open(tmp_path / "s3").read(0, len(TEXTS)), first.read(0, len(TEXTS)))
    # --base-model that is not a model, and --base-model with a full model: one line each
    line = error_line(invoke(runner, "collect", run.adapter, run.train, "--out", tmp_path / "s4", "--base-model",
                             tmp_path / "nowhere", *COLLECT, code=2))
    assert line.startswith(f"Error: --base-model {tmp_path / 'nowhere'}")
    line = error_line(invoke(runner, "collect", run.base, run.train, "--out", tmp_path / "s5", "--base-model",
                             other, *COLLECT, code=2))
    assert "is a full model directory" in line and "drop --base-model" in line


def test_attribute_on_a_lora_run_scores_its_adapter_checkpoints(run, runner, tmp_path):
    """gradtrace attribute on a LoRA Trainer output directory: one store per adapter checkpoint (base from
    adapter_config.json), the ensemble scored latest first, equal to scoring the same stores by hand."""
    out = tmp_path / "attribution"
    result = invoke(runner, "attribute", run.out, run.train, run.queries, "--out", out, "--rank", RANK, "--k", 3,
                    "--no-progress")
    assert "2 checkpoints" in result.output
    stores = out / "stores"
    assert sorted(p.name for p in stores.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    spec = gradtrace.GradientStore.open(stores / "checkpoint-4").spec
    assert spec.params and all("lora_" in name for name, _ in spec.params)  # the adapters, as in training
    invoke(runner, "score", stores / "checkpoint-4", run.queries, "--store", stores / "checkpoint-2", "--method",
           "grad_cos", "--out", tmp_path / "by_hand", "--topk", 3, "--no-progress")
    got, want = gradtrace.Scores.load(out / "scores"), gradtrace.Scores.load(tmp_path / "by_hand")
    assert torch.equal(got.top[1], want.top[1]) and torch.equal(got.top[0], want.top[0])
    assert (out / "report.html").exists()


def test_collect_checkpoints_takes_lora_checkpoint_directories(run):
    """gradtrace.collect_checkpoints on a LoRA run's checkpoint-N directories: each loaded on the base its
    adapter_config.json names, trainable, and collected as the Python API does on that PeftModel."""
    batches = _batches(run.base, run.train, 4)
    checkpoints = [run.out / "checkpoint-2", run.out / "checkpoint-4"]
    projection = gradtrace.LoGra(rank=RANK)
    sets = gradtrace.collect_checkpoints(checkpoints, batches, options=CaptureOptions(projection=projection))
    for checkpoint, got in zip(checkpoints, sets):
        want = gradtrace.collect(_peft(run.base, checkpoint), batches, options=CaptureOptions(projection=projection))
        assert [n for n, _ in got.spec.params] == [n for n, _ in want.spec.params]
        assert _max_row_error(got.read(0, len(got)), want.read(0, len(want))) < 1e-5
