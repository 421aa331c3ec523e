"""The report reads its texts through gradtrace.data with the recorded data options: prompt/completion data with
content-hash ids or renamed fields gets the ids gradtrace.data (hence ``gradtrace collect``) gave it."""

from __future__ import annotations

import json

import pytest

import gradtrace.data as gd
from gradtrace.options.data import ReadOptions
from gradtrace.report import DataSource, ReportError, read_texts
from tests.data.conftest import PAIRS, gpt2, make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(path)
    gpt2(len(tokenizer)).config.save_pretrained(path)  # a model directory (the tokenizer is what is read)
    return path


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_prompt_completion_texts_under_content_hash_ids(tmp_path, model_dir):
    data = _write(tmp_path / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    texts = read_texts(DataSource(data, model=model_dir, max_length=8))
    expected = gd.load(data, make_tokenizer(), read_options=ReadOptions(max_length=8, truncate=True))
    assert list(texts) == expected.ids
    assert list(texts.values()) == [p + c for p, c in PAIRS]


def test_recorded_field_names_are_used(tmp_path, model_dir):
    data = _write(tmp_path / "qa.jsonl", [{"key": f"q{i}", "question": p, "answer": c}
                                          for i, (p, c) in enumerate(PAIRS)])
    recorded = {"prompt_field": "question", "completion_field": "answer"}
    texts = read_texts(DataSource(data, id_field="key", model=model_dir, recorded=recorded))
    assert texts == {f"q{i}": p + c for i, (p, c) in enumerate(PAIRS)}
    with pytest.raises(ReportError, match=r"qa\.jsonl"):  # without them: a one-line error naming the file
        read_texts(DataSource(data, id_field="key", model=model_dir))
