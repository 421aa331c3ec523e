"""GradtraceCallback with TRL's SFTTrainer: completion-only loss, fused LM head, PEFT LoRA."""

from __future__ import annotations

import pytest

from gradtrace.options import CaptureOptions

pytest.importorskip("trl")

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

import gradtrace
from gradtrace.integrations.hf import GradtraceCallback
from tests import tiny
from tests.integrations.common import (
    WeightRecorder,
    assert_rows_close,
    causal_loss,
    char_tokenizer,
    reference_rows,
)

PAIRS = [("what is up? ", "nothing much"), ("say hi. ", "hi there"), ("count: ", "one two three"),
         ("name? ", "bob"), ("color? ", "a deep blue"), ("where? ", "at home"), ("when? ", "soon"),
         ("why? ", "because it rains")]


def _sft(tmp_path, model, callback, peft_config=None, **overrides):
    data = Dataset.from_dict({"id": [f"pair-{i}" for i in range(len(PAIRS))], "prompt": [p for p, _ in PAIRS],
                              "completion": [c for _, c in PAIRS]})
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=5e-2,
                    report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                    completion_only_loss=True, seed=0, bf16=False)  # fp32 for exact comparisons; TRL's default
    # gradient checkpointing (non-reentrant) stays on: the capture pairs the re-run forwards
    settings.update(overrides)
    recorder = WeightRecorder()
    trainer = SFTTrainer(model=model, args=SFTConfig(str(tmp_path / "out"), **settings), train_dataset=data,
                         processing_class=char_tokenizer(), peft_config=peft_config, callbacks=[recorder, callback])
    trainer.train()
    examples = {row["id"]: row for row in trainer.train_dataset}  # tokenized: input_ids, labels (-100 = prompt)
    return trainer, recorder, examples


def test_sft_completion_only_loss_equals_brute_force(tmp_path):
    """Full fine-tuning of a tied GPT-2: TRL's fused LM head is unfused so lm_head/wte are captured exactly;
    only completion tokens are targets."""
    callback = GradtraceCallback(tmp_path / "store", ids="id")
    trainer, recorder, examples = _sft(tmp_path, tiny.gpt2(tied=True), callback)
    store = callback.result()
    config = store.manifest["config"]["trainer"]
    assert config["trainer"] == "SFTTrainer" and config["fused_lm_head"] == "unfused"
    assert config["check"]["loss_ratio"] == pytest.approx(1, abs=1e-5)
    assert len(store) == 8 and all(i.startswith("pair-") for i in store.ids)
    assert any(-100 in examples[i]["labels"] for i in store.ids)  # prompts are masked
    got, want = reference_rows(trainer.model, store, recorder.states, examples, causal_loss)
    assert_rows_close(store, got, want)
    # the prompt tokens are not targets: a loss over every token gives other gradients
    full = {i: {"input_ids": e["input_ids"]} for i, e in examples.items()}
    _, everything = reference_rows(trainer.model, store, recorder.states, full, causal_loss)
    assert (everything - want).abs().max() > 1e-2 * want.abs().max()


def test_sft_lora_captures_only_the_adapters(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    projection = gradtrace.LoGra(rank=2, vector_rank=2)
    callback = GradtraceCallback(tmp_path / "store", ids="id", options=CaptureOptions(projection=projection))
    trainer, recorder, examples = _sft(tmp_path, tiny.llama(), callback, peft_config=lora)
    store = callback.result()
    names = [n for n, _ in store.spec.params]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert store.manifest["config"]["trainer"].get("fused_lm_head") is None  # the frozen head stays fused
    got, want = reference_rows(trainer.model, store, recorder.states, examples, causal_loss, projection)
    assert_rows_close(store, got, want)
    assert float(want.abs().max()) > 0 and torch.isfinite(got).all()


def test_unfused_head_returns_the_fused_heads_values():
    """The unfused forward gives TRL's fields with the values TRL's fused head computes."""
    from trl.trainer.utils import add_fused_lm_head

    from gradtrace.integrations.fused_head import UnfusedLMHead

    model = tiny.gpt2(tied=True)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits"))
    ids = torch.randint(2, tiny.VOCAB, (3, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    fused = model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=torch.tensor(11))
    unfused_head = UnfusedLMHead(model)
    unfused_head.install()
    try:
        unfused = model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=torch.tensor(11))
    finally:
        unfused_head.remove()
    assert unfused_head.used and not model._forward_hooks
    for field in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert torch.allclose(getattr(unfused, field), getattr(fused, field), atol=1e-5), field
    assert torch.equal(unfused.is_top1, fused.is_top1) and torch.equal(unfused.label_mask, fused.label_mask)
