"""Bad input: one clear error naming the source, the line or row and what to do -- raised while reading,
before anything is collected."""

from __future__ import annotations

import json

import pytest

import gradtrace.data as gd
from gradtrace.options.data import Fields, ReadOptions
from tests.data.conftest import CONVERSATIONS, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _jsonl(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _error(tok, source, **kwargs) -> str:
    with pytest.raises(gd.DataError) as err:
        gd.load(source, tok, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_misnamed_fields_list_what_was_found_and_the_formats(tmp_path, tok):
    path = _jsonl(tmp_path, [{"question": "what?", "answer": "that"}])
    message = _error(tok, path)
    assert f"{path} line 1 has no 'text' field (it has: answer, question)" in message
    assert "prompt-completion ('prompt' + 'completion')" in message and "messages ('messages')" in message
    assert "--prompt-field" in message
    # named: it reads
    data = gd.load(path, tok, fields=Fields(prompt="question", completion="answer"))
    assert data.summary.format == "prompt-completion"
    # half a format
    message = _error(tok, _jsonl(tmp_path, [{"prompt": "what?", "answer": "that"}], "half.jsonl"))
    assert "has 'prompt' but no 'completion' field" in message
    # an explicit format whose fields are missing
    message = _error(tok, _jsonl(tmp_path, [{"text": "hello"}], "t.jsonl"),
                     read_options=ReadOptions(format="messages"))
    assert "line 1 has no 'messages' field (format messages)" in message


def test_mixed_formats(tmp_path, tok):
    path = _jsonl(tmp_path, [{"prompt": "a", "completion": " b"}, {"text": "hello"}])
    assert f"{path} line 2 is text data but {path} line 1 is prompt-completion" in _error(tok, path)
    path = _jsonl(tmp_path, [{"prompt": "a", "completion": " b"},
                             {"prompt": CONVERSATIONS[0][:1], "completion": CONVERSATIONS[0][1:]}], "conv.jsonl")
    assert "line 2 has message lists for prompt/completion but" in _error(tok, path)


def test_empty_completion_and_conversations_without_assistant(tmp_path, tok):
    path = _jsonl(tmp_path, [{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": "  "}])
    assert f"{path} line 2 has an empty 'completion'" in _error(tok, path)
    path = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": "hello"}]}], "noassistant.jsonl")
    message = _error(tok, path)
    assert f"{path} line 1 has no assistant turn" in message and "--loss-on all" in message
    assert gd.load(path, tok, read_options=ReadOptions(loss_on="all")).num_examples == 1
    path = _jsonl(tmp_path, [{"messages": [{"role": "user"}]}], "nocontent.jsonl")
    assert "message 0 of 'messages' needs a string 'role' and 'content'" in _error(tok, path)


def test_conversations_need_a_chat_template(tmp_path):
    path = _jsonl(tmp_path, [{"messages": CONVERSATIONS[0]}])
    message = _error(make_tokenizer(None), path)
    assert str(path) in message and "no chat template" in message


def test_not_utf8_not_json_not_an_object(tmp_path, tok):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"text": "café"}).encode("latin-1").replace(b"\\u00e9", b"\xe9") + b"\n")
    assert f"{path} is not UTF-8 text" in _error(tok, path)
    csv = tmp_path / "latin1.csv"
    csv.write_bytes("prompt,completion\ncaf\xe9,ok\n".encode("latin-1"))
    message = _error(tok, csv)
    assert str(csv) in message and "UTF-8" in message
    path = _jsonl(tmp_path, ['{"text": "fine"}', '{"text": broken'], "bad.jsonl")
    assert f"{path} line 2 is not valid JSON" in _error(tok, path)


def test_ids(tmp_path, tok):
    path = _jsonl(tmp_path, [{"id": 1, "text": "one"}, {"id": 1, "text": "two"}])
    assert "id '1' appears on lines 1 and 2; ids must be unique" in _error(tok, path)
    path = _jsonl(tmp_path, [{"id": 1, "text": "one"}, {"text": "two"}], "some.jsonl")
    assert "line 1 has an 'id' field but line 2 has none" in _error(tok, path)
    path = _jsonl(tmp_path, [{"id": [1], "text": "one"}], "list.jsonl")
    assert "must be a string or an integer" in _error(tok, path)


def test_empty_sources(tmp_path, tok):
    path = _jsonl(tmp_path, [])
    assert f"{path} holds no examples" in _error(tok, path)
    assert "holds no examples" in _error(tok, [])
    path = tmp_path / "empty.txt"
    path.write_text("hello\n\n", encoding="utf-8")
    path.write_text("\n", encoding="utf-8")
    assert "holds no examples" in _error(tok, path)


def test_sources_and_options(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    assert "does not exist" in _error(tok, tmp_path / "missing.jsonl")
    assert "unknown format '.xlsx'" in _error(tok, _jsonl(tmp_path, [], "data.xlsx"))
    (tmp_path / "plain").mkdir()
    assert "is a directory but not a dataset written by datasets' save_to_disk" in _error(tok, tmp_path / "plain")
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                                 "test": datasets.Dataset.from_list([{"text": "b"}])})
    assert "splits train, test; choose one with --split" in _error(tok, both)
    assert "has no split 'valid' (it has: train, test)" in _error(tok, both, read_options=ReadOptions(split="valid"))
    assert "--split 'train' applies to a DatasetDict" in _error(tok, _jsonl(tmp_path, [{"text": "a"}]),
                                                                 read_options=ReadOptions(split="train"))
    assert "--loss-on assistant does not apply to prompt-completion data" in _error(
        tok, [{"prompt": "a", "completion": " b"}], read_options=ReadOptions(loss_on="assistant"))
    assert "'text' is a int, not a string" in _error(tok, [{"text": 3}])
