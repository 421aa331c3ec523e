"""One id rule: the content-hash ids of gradtrace.data, of the capture (``collect``) and of the Hugging Face Trainer
callback come from the same function and number repeated content the same way (``digest``, ``digest#1``, ...)."""

from __future__ import annotations

import numpy as np
import pytest

import gradtrace
import gradtrace.data as gd
from gradtrace.data.ids import ContentIds, content_hash
from gradtrace.options.data import BatchOptions
from tests.data.conftest import PAIRS, gpt2, make_tokenizer, sft_store

# two copies of the first pair and three of the second: repeats get #1, #2
RECORDS = [{"prompt": p, "completion": c} for p, c in PAIRS[:3] + PAIRS[:2] + PAIRS[1:2]]


def test_content_ids_number_repeats_and_reset():
    digests = [content_hash(np.asarray(t, dtype=np.int64)) for t in ([1, 2], [3], [1, 2], [1, 2])]
    numbering = ContentIds()
    assert numbering.number(digests) == [digests[0], digests[1], f"{digests[0]}#1", f"{digests[0]}#2"]
    assert numbering.number(digests[:1]) == [f"{digests[0]}#3"]  # counted across calls of one pass
    numbering.reset()
    assert numbering.number(digests[:1]) == [digests[0]]
    assert len(digests[0]) == 16 and int(digests[0], 16) >= 0  # 16 hex digits
    assert content_hash(np.asarray([1, 2], dtype=np.int32)) != digests[0]  # the dtype is hashed too


def test_capture_numbers_content_ids_with_the_data_layer_rule():
    from gradtrace.capture import context, example_ids

    assert context.content_hash is content_hash and example_ids.ContentIds is ContentIds
    tok = make_tokenizer()
    data = gd.load(RECORDS, tok, batch_options=BatchOptions(batch_size=4))
    assert sum("#" in i for i in data.ids) == 3
    batches = [{k: v for k, v in batch.items() if k != "id"} for batch in data]  # the capture hashes the tokens
    grads = gradtrace.collect(gpt2(len(tok)), batches)
    assert list(grads.ids) == data.ids


def test_trainer_callback_numbers_repeats_as_the_data_layer_each_epoch(tmp_path):
    pytest.importorskip("trl")
    tok = make_tokenizer()
    store = sft_store(tmp_path, RECORDS, tok, num_train_epochs=2)
    ids = gd.load(RECORDS, tok).ids
    assert sorted(store.ids) == sorted(ids)  # second epoch: the same ids again (numbering reset)
