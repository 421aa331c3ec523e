"""Every source kind reads to the same examples, ids and gradients: JSONL = JSON = Parquet = CSV =
save_to_disk (Dataset and DatasetDict split) = in-memory Dataset = list of dicts; large tables are read in
record batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gradtrace
import gradtrace.data as gd
from gradtrace.data import prepare, sources
from gradtrace.options.data import BatchOptions, ReadOptions
from tests.data.conftest import conversation_records, gpt2, make_tokenizer, pair_records

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")


def _write(kind: str, records: list[dict], root):
    """``records`` as source ``kind``: ``(source, split)``."""
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    if kind == "jsonl":
        path = root / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif kind == "json":
        path = root / "data.json"
        path.write_text(json.dumps(records), encoding="utf-8")
    elif kind == "parquet":
        path = root / "data.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    elif kind == "csv":
        path = root / "data.csv"
        pa_csv.write_csv(pa.Table.from_pylist(records), path)
    elif kind == "save_to_disk":
        path = root / "disk"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    elif kind == "dataset_dict":
        path = root / "dict"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                              "test": datasets.Dataset.from_list(records[:1])}).save_to_disk(str(path))
        return path, "train"
    elif kind == "dataset":
        return datasets.Dataset.from_list(records), None
    elif kind == "iterable":
        return datasets.Dataset.from_list(records).to_iterable_dataset(num_shards=2), None
    else:
        return [dict(r) for r in records], None
    return path, None


def _same(a, b) -> None:
    assert a.ids == b.ids
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss, b.loss)
    assert np.array_equal(a.lengths, b.lengths)
    assert (a.summary.examples, a.summary.format, a.summary.loss_tokens) == \
        (b.summary.examples, b.summary.format, b.summary.loss_tokens)


KINDS = ["jsonl", "json", "parquet", "csv", "save_to_disk", "dataset_dict", "dataset", "iterable", "list"]


@pytest.mark.parametrize("with_ids", [True, False])
def test_prompt_completion_sources_round_trip_to_the_same_gradients(tmp_path, with_ids):
    tok = make_tokenizer()
    model = gpt2(len(tok))
    records = pair_records(with_ids)
    reference = gd.load(records, tok, batch_options=BatchOptions(batch_size=4))
    want = gradtrace.collect(model, reference)
    for kind in KINDS:
        (tmp_path / kind).mkdir()
        source, split = _write(kind, records, tmp_path / kind)
        data = gd.load(source, tok, read_options=ReadOptions(split=split), batch_options=BatchOptions(batch_size=4))
        _same(data, reference)
        got = gradtrace.collect(model, data)
        assert got.ids == want.ids
        torch.testing.assert_close(got.vectors, want.vectors, rtol=0, atol=0)  # same batches: same arithmetic


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "save_to_disk", "dataset", "list"])
def test_conversations_round_trip(tmp_path, kind):
    tok = make_tokenizer()
    records = conversation_records()
    source, split = _write(kind, records, tmp_path)
    _same(gd.load(source, tok, read_options=ReadOptions(split=split)), gd.load(records, tok))


def test_parquet_and_arrow_are_read_in_record_batches(tmp_path, monkeypatch):
    """Chunks of ``CHUNK_ROWS`` records: the same result as one chunk, content-hash repeats counted across
    chunks, and no chunk larger than asked."""
    tok = make_tokenizer()
    records = [{"prompt": f"count to {w}:", "completion": " one two three"} for w in ("three", "two", "one")] * 5
    source, _ = _write("parquet", records, tmp_path)
    whole = gd.load(source, tok)
    seen: list[int] = []
    original = prepare.tokenize_chunk

    def spy(records, *args):
        seen.append(len(records))
        return original(records, *args)

    monkeypatch.setattr(sources, "CHUNK_ROWS", 4)
    monkeypatch.setattr(prepare, "tokenize_chunk", spy)
    for kind in ("parquet", "save_to_disk", "csv", "jsonl"):
        (tmp_path / kind).mkdir()
        path, _ = _write(kind, records, tmp_path / kind)
        seen.clear()
        chunked = gd.load(path, tok)
        _same(chunked, whole)
        assert max(seen) <= 4 and sum(seen) >= len(records), (kind, seen)
    assert len(set(whole.ids)) == len(records) and sum("#" in i for i in whole.ids) == 12


def test_text_sources_keep_the_command_line_ids(tmp_path):
    """Plain text: the ids are the content hashes the CLI and gradtrace.capture have always computed."""
    from gradtrace.capture.context import content_hash

    tok = make_tokenizer()
    path = tmp_path / "lines.txt"
    path.write_text("hello there\n\nhello there\nthe capital of france\n", encoding="utf-8")
    data = gd.load(path, tok)
    first = content_hash(np.asarray(tok("hello there")["input_ids"], dtype=np.int64))
    assert data.ids == [first, f"{first}#1", content_hash(np.asarray(tok("the capital of france")["input_ids"],
                                                                     dtype=np.int64))]
    assert data.summary.format == "text" and data.summary.loss_on == "all" and "labels" not in next(iter(data))
