"""Text examples and EOS: off by default (the content-hash ids of existing stores stay), ``add_eos=True`` /
``--eos`` tokenizes each text exactly as TRL's SFTTrainer does for language modelling (EOS text appended unless
the text ends with it, then tokenized), and is refused where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest

import gradtrace.data as gd
from gradtrace.data.ids import content_hash
from gradtrace.options.data import ReadOptions
from tests.data.conftest import CORPUS, PAIRS, gpt2, make_tokenizer

TEXTS = [*CORPUS[:4], CORPUS[4] + "<eos>"]  # the last one already ends with EOS: not doubled


def _tokens(data: gd.TokenizedDataset) -> list[list[int]]:
    return [data.example(i)[0].tolist() for i in range(data.num_examples)]


def test_default_text_tokens_and_ids_have_no_eos():
    tok = make_tokenizer()
    data = gd.load([{"text": t} for t in TEXTS], tok)
    assert _tokens(data) == tok(TEXTS)["input_ids"]
    assert data.ids == [content_hash(np.asarray(t, dtype=np.int64)) for t in tok(TEXTS)["input_ids"]]
    assert "EOS" not in data.summary.line()


def test_add_eos_appends_it_once_and_puts_it_in_the_loss():
    tok = make_tokenizer()
    data = gd.load([{"text": t} for t in TEXTS], tok, read_options=ReadOptions(add_eos=True))
    expected = tok([t + "<eos>" for t in TEXTS[:4]] + TEXTS[4:])["input_ids"]
    assert _tokens(data) == expected and all(t[-1] == tok.eos_token_id for t in expected)
    assert expected[4].count(tok.eos_token_id) == 1
    assert all(data.example(i)[1].all() for i in range(len(TEXTS)))  # every token, EOS included, in the loss
    assert data.ids == [content_hash(np.asarray(t, dtype=np.int64)) for t in expected]
    assert data.ids[:4] != gd.load([{"text": t} for t in TEXTS[:4]], tok).ids  # other tokens, other ids
    assert "text (EOS appended), loss on all" in data.summary.line()


def test_add_eos_equals_trl_sft_trainer_language_modelling_tokens(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = make_tokenizer()
    args = SFTConfig(str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, dataset_num_proc=None)
    trainer = SFTTrainer(model=gpt2(len(tok)), args=args, train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]),
                         processing_class=tok)
    ours = gd.load([{"text": t} for t in TEXTS], tok, read_options=ReadOptions(add_eos=True))
    assert _tokens(ours) == trainer.train_dataset["input_ids"]


def test_add_eos_is_refused_where_it_does_not_apply():
    tok = make_tokenizer()
    with pytest.raises(gd.DataError, match=r"is prompt-completion data: --eos \(add_eos\) applies to text examples"):
        gd.load([{"prompt": p, "completion": c} for p, c in PAIRS], tok, read_options=ReadOptions(add_eos=True))
    with pytest.raises(gd.DataError, match=r"--generate makes prompt/answer examples"):
        gd.load([{"id": "a", "prompt": "hello"}], tok, read_options=ReadOptions(add_eos=True),
                generate=gd.Generate(gpt2(len(tok))))
    tok.eos_token = None
    with pytest.raises(gd.DataError, match=r"no EOS token, which --eos appends to each text"):
        gd.load([{"text": "hello there"}], tok, read_options=ReadOptions(add_eos=True))
