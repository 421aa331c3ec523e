"""Ids agree across entry points: a store captured during TRL's SFTTrainer run with content-hash ids holds the
ids gradtrace.data gives the same prompt/completion examples (TRL tokenizes them as gradtrace.data does), so
scores join training-time stores and command-line data."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import gradtrace.data as gd
from tests.data.conftest import PAIRS, gpt2, make_tokenizer


def test_sft_trainer_content_hash_ids_equal_gradtrace_data_ids(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from gradtrace.integrations.hf import GradtraceCallback

    tok = make_tokenizer()
    records = [{"prompt": p, "completion": c} for p, c in PAIRS]
    callback = GradtraceCallback(tmp_path / "store", ids=None)
    args = SFTConfig(str(tmp_path / "out"), per_device_train_batch_size=3, max_steps=2, learning_rate=1e-3,
                     report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_strategy="no",
                     disable_tqdm=True, completion_only_loss=True, seed=0, gradient_checkpointing=False)
    SFTTrainer(model=gpt2(len(tok)), args=args, train_dataset=Dataset.from_list(records), processing_class=tok,
               callbacks=[callback]).train()
    store = callback.result()
    assert sorted(store.ids) == sorted(gd.load(records, tok).ids)
