"""The data option objects (``gradtrace.options.data``): checked when made, the one way to configure
``gradtrace.data.load``, and the commands' flags build the same objects."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import gradtrace.data as gd
from gradtrace.options.data import BatchOptions, Fields, ReadOptions
from tests.data.conftest import make_tokenizer

PAIRS = [{"key": "a", "question": "what is the capital of france?", "answer": " paris"},
         {"key": "b", "question": "count to three:", "answer": " one two three"},
         {"key": "c", "question": "why is the sky blue?", "answer": " because it rains and rains"}]
TEXTS = [{"body": "hello there how are you"}, {"body": "the capital of france is paris"},
         {"body": "hello there how are you"}, {"body": "hello"}]


@pytest.mark.parametrize("build,message", [
    (lambda: ReadOptions(max_length=1), "max_length must be an integer >= 2"),
    (lambda: ReadOptions(max_length=2.5), "max_length must be"),
    (lambda: ReadOptions(format="chat"), "format must be one of"),
    (lambda: ReadOptions(loss_on="prompt"), "loss_on must be one of"),
    (lambda: BatchOptions(batch_size=0), "batch_size must be an integer >= 1"),
    (lambda: BatchOptions(batch_size=math.inf), "batch_size must be"),
    (lambda: BatchOptions(pad_id=-1), "pad_id must be an integer >= 0"),
    (lambda: Fields(text=""), "Fields.text must be a non-empty field name"),
    (lambda: Fields(id=3), "Fields.id must be a non-empty field name"),
], ids=["max-length-1", "max-length-float", "format", "loss-on", "batch-size-0", "batch-size-inf", "pad-id",
        "empty-field", "field-not-a-string"])
def test_a_bad_setting_is_refused_when_the_object_is_made_on_one_line_naming_it(build, message):
    with pytest.raises(ValueError, match=message) as err:
        build()
    assert "\n" not in str(err.value)


def test_the_objects_are_frozen_keyword_only_and_their_defaults_are_loads():
    for cls in (Fields, ReadOptions, BatchOptions):
        params = dataclasses.fields(cls)
        assert all(f.kw_only for f in params), cls
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cls(), params[0].name, None)
    assert dataclasses.asdict(Fields()) == {"text": "text", "prompt": "prompt", "completion": "completion",
                                            "messages": "messages", "chosen": "chosen", "rejected": "rejected",
                                            "id": "id"}
    assert dataclasses.asdict(ReadOptions()) == {"format": "auto", "split": None, "loss_on": "auto",
                                                 "max_length": None, "truncate": False, "add_eos": False,
                                                 "keep_text": False}
    assert dataclasses.asdict(BatchOptions()) == {"batch_size": 8, "pad_id": None}


def test_load_refuses_an_option_argument_of_another_type():
    with pytest.raises(TypeError, match=r"read_options= must be a .*ReadOptions, got BatchOptions"):
        gd.load(TEXTS, make_tokenizer(), read_options=BatchOptions())
    with pytest.raises(TypeError, match=r"fields= must be a .*Fields, got dict"):
        gd.load(TEXTS, make_tokenizer(), fields={"text": "body"})


def _rows(data: gd.TokenizedDataset) -> list[list[list[int]]]:
    return [[t.tolist(), m.astype(int).tolist()] for t, m in map(data.example, range(data.num_examples))]


def test_prompt_completion_with_named_fields_gives_the_tokens_ids_and_masks_it_always_gave():
    """Values recorded from ``load(..., prompt_field=, completion_field=, id_field=, max_length=7, keep_text=True,
    batch_size=2)`` before the options moved into option objects."""
    data = gd.load(PAIRS, make_tokenizer(), fields=Fields(prompt="question", completion="answer", id="key"),
                   read_options=ReadOptions(max_length=7, keep_text=True), batch_options=BatchOptions(batch_size=2))
    assert data.ids == ["a", "b", "c"]
    assert _rows(data) == [[[269, 300, 297, 303, 36, 363, 1], [0, 0, 0, 0, 0, 1, 1]],
                           [[338, 298, 31, 349, 339, 298, 1], [0, 0, 0, 1, 1, 1, 1]],
                           [[36, 365, 331, 364, 342, 364, 1], [0, 1, 1, 1, 1, 1, 1]]]
    first, second = list(data)
    assert first["id"] == ["a", "b"] and second["id"] == ["c"]
    assert first["labels"].tolist() == [[-100, -100, -100, -100, -100, 363, 1], [-100, -100, -100, 349, 339, 298, 1]]
    assert data.texts == ["what is the capital of france? paris", "count to three: one two three",
                          "why is the sky blue? because it rains and rains"]
    assert data.summary.line() == ("in-memory list: 3 examples, prompt-completion, loss on completion: 12 of 21 tokens "
                                   "(57.1%), 3 truncated (prompt cut from the left), ids from 'key'")


def test_text_with_eos_truncation_and_a_given_pad_gives_the_tokens_and_content_ids_it_always_gave():
    """Values recorded from ``load(..., text_field="body", max_length=5, truncate=True, add_eos=True,
    batch_size=4, pad_id=5)`` before the options moved into option objects."""
    data = gd.load(TEXTS, make_tokenizer(), fields=Fields(text="body"),
                   read_options=ReadOptions(max_length=5, truncate=True, add_eos=True),
                   batch_options=BatchOptions(batch_size=4, pad_id=5))
    assert data.ids == ["28995f7804f1f2d5", "6fe9908dcd671c39", "28995f7804f1f2d5#1", "fb9f73805762a405"]
    (batch,) = list(data)
    assert batch["input_ids"].tolist() == [[355, 346, 353, 293, 290], [327, 300, 297, 303, 270],
                                           [355, 346, 353, 293, 290], [355, 1, 5, 5, 5]]
    assert batch["attention_mask"].tolist()[3] == [1, 1, 0, 0, 0] and "labels" not in batch
    assert data.batch_options == BatchOptions(batch_size=4, pad_id=5)
    assert data.summary.cut == 3 and data.summary.eos_added


def test_the_default_pad_is_the_tokenizers_and_a_dataset_needs_one():
    tok = make_tokenizer()
    data = gd.load(TEXTS, tok, fields=Fields(text="body"))
    assert data.batch_options == BatchOptions(batch_size=8, pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match=r"needs batch_options\.pad_id"):
        gd.TokenizedDataset(data.tokens, data.loss, data.lengths, data.ids, data.summary,
                            batch_options=BatchOptions())


def test_texts_reads_with_the_same_objects_and_ids():
    tok = make_tokenizer()
    fields, read = Fields(text="body"), ReadOptions(max_length=5, add_eos=True)
    shown = gd.texts(TEXTS, tok, fields=fields, read_options=read)
    assert list(shown) == gd.load(TEXTS, tok, fields=fields, read_options=ReadOptions(max_length=5, truncate=True,
                                                                                       add_eos=True)).ids
    assert shown["fb9f73805762a405"] == "hello"


def test_the_commands_data_flags_build_the_same_objects():
    from gradtrace.cli.groups import DataOptions

    opts = DataOptions(data_format="prompt-completion", prompt_field="question", completion_field="answer",
                       id_field="key", loss_on="all", batch_size=3, truncate=True)
    assert opts.record_fields() == Fields(prompt="question", completion="answer", id="key")
    assert opts.read_options(64) == ReadOptions(format="prompt-completion", loss_on="all", max_length=64,
                                                truncate=True)
    assert DataOptions(split="train", eos=True).read_options(None) == ReadOptions(split="train", add_eos=True)
    assert opts.batch_options(0) == BatchOptions(batch_size=3, pad_id=0)
    defaults = DataOptions()
    assert (defaults.record_fields(), defaults.read_options(None)) == (Fields(), ReadOptions())
    assert defaults.batch_options(None) == BatchOptions()
    assert np.array_equal(  # and the loaded examples are those of the Python call
        gd.load(PAIRS, make_tokenizer(), fields=opts.record_fields(), read_options=opts.read_options(64),
                batch_options=opts.batch_options(0)).tokens,
        gd.load(PAIRS, make_tokenizer(), fields=Fields(prompt="question", completion="answer", id="key"),
                read_options=ReadOptions(loss_on="all")).tokens)
