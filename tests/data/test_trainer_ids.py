"""Ids agree across entry points: a store captured during TRL's SFTTrainer run with content-hash ids holds the
ids gradtrace.data gives the same prompt/completion examples (TRL tokenizes them as gradtrace.data does), so
scores join training-time stores and command-line data."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import gradtrace.data as gd
from tests.data.conftest import PAIRS, make_tokenizer, sft_store


def test_sft_trainer_content_hash_ids_equal_gradtrace_data_ids(tmp_path):
    tok = make_tokenizer()
    records = [{"prompt": p, "completion": c} for p, c in PAIRS]
    store = sft_store(tmp_path, records, tok, max_steps=2)
    assert sorted(store.ids) == sorted(gd.load(records, tok).ids)
