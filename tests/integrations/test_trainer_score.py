"""A store written during training records its model directory (the Trainer's output dir), the checkpoints it saw
saved (with their weights) and the captured step range: ``gradtrace score`` then needs no ``--model`` and does not
warn that the weights differ for a checkpoint inside that range or the final model (issue #17)."""

from __future__ import annotations

import json

import torch
from datasets import Dataset
from transformers import Trainer
from typer.testing import CliRunner

import gradtrace
from gradtrace.cli import app
from gradtrace.integrations.hf import GradtraceCallback, checkpoints
from gradtrace.integrations.trainer_store import trained_weights
from gradtrace.options import CaptureOptions
from gradtrace.store.spec import model_fingerprint
from tests import tiny
from tests.integrations.common import char_tokenizer, lm_rows, pad_collate, training_args

WARNING = "differ from those of the model"


def _score(tmp_path, store, out, *extra, code=0):
    result = CliRunner().invoke(app, [str(a) for a in ("score", store, tmp_path / "queries.txt", "--out", out,
                                                      "--topk", 2, "--no-progress", *extra)])
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


def test_score_a_trainer_store_without_model_and_with_its_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = tiny.gpt2(pad_token_id=0)
    callback = GradtraceCallback(tmp_path / "store", start_step=2,
                                 options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "out"), max_steps=4, save_strategy="steps",
                                                      save_steps=1),
                      train_dataset=Dataset.from_list(lm_rows(12)), data_collator=pad_collate,
                      processing_class=char_tokenizer(), callbacks=[callback])
    trainer.train()
    (tmp_path / "queries.txt").write_text("the king speaks.\nfair is foul, and foul is fair.\n")
    store = tmp_path / "store"
    # nothing saved in the output dir yet: a clear error naming what to do
    assert "holds no saved model" in _score(tmp_path, store, tmp_path / "s0", code=2)
    trainer.save_model()

    config = json.loads((store / "manifest.json").read_text())["config"]
    assert config["model"] == "../out" and config["trainer"]["output_dir"] == "../out"
    assert config["trainer"]["steps"] == {"first": 2, "last": 3}
    assert sorted(set(callback.result().field("step"))) == [2, 3]
    saved = checkpoints(store)
    assert [c["path"] for c in saved] == [str(tmp_path / "out" / f"checkpoint-{s}") for s in (1, 2, 3, 4)]
    assert [c["path"] for c in config["trainer"]["checkpoints"]] == [f"../out/checkpoint-{s}" for s in (1, 2, 3, 4)]
    from transformers import GPT2LMHeadModel

    for c in saved:  # the recorded fingerprint is that of the model loaded from the checkpoint
        assert c["weights"] == model_fingerprint(GPT2LMHeadModel.from_pretrained(c["path"]))["weights"]
    final = model_fingerprint(model)["weights"]
    assert config["trainer"]["final"] == {"step": 4, "weights": final}
    assert trained_weights(store) == {saved[1]["weights"]: "checkpoint-2", saved[2]["weights"]: "checkpoint-3",
                                      final: "the final model (step 4)"}

    # no --model: the final model in the output dir, no warning
    assert WARNING not in _score(tmp_path, store, tmp_path / "s1")
    scores = gradtrace.Scores.load(tmp_path / "s1")
    assert scores.meta["config"]["model"] == [str(tmp_path / "out")]
    for step in (2, 3):  # checkpoints inside the captured range: no warning
        assert WARNING not in _score(tmp_path, store, tmp_path / f"s{step}", "--model",
                                     tmp_path / "out" / f"checkpoint-{step}")
    # a checkpoint before the captured range holds other weights: the warning stays
    assert WARNING in _score(tmp_path, store, tmp_path / "before", "--model", tmp_path / "out" / "checkpoint-1")
