"""The commands read data through gradtrace.data: prompt/completion and chat formats, renamed fields,
Parquet and save_to_disk sources, --split, --loss-on, the one-line summary; bad data leaves a store as it was."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import gradtrace
import gradtrace.data as gd
from gradtrace.options.data import BatchOptions
from tests.cli.conftest import error_line, invoke

PAIRS = [("The king speaks:", " fair is foul"), ("The queen hears:", " sweet love and war"),
         ("Night and day:", " the sword and the crown"), ("My lord:", " come hither")]


def _records(prompt="prompt", completion="completion"):
    return [{"id": f"q{i}", prompt: p, completion: c} for i, (p, c) in enumerate(PAIRS)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _tree_digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_collect_prompt_completion_equals_python_api(ws, runner, fresh):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _jsonl(fresh / "sft.jsonl", _records())
    out = invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--projection", "none", "--batch-size", 3,
                 "--no-progress").stdout
    summary = " ".join(out.split())
    assert f"{data}: 4 examples, prompt-completion, loss on completion:" in summary
    assert "0 truncated (prompt cut from the left), ids from 'id'" in summary
    store = gradtrace.GradientStore.open(fresh / "s")
    tok = AutoTokenizer.from_pretrained(ws.model)
    model = AutoModelForCausalLM.from_pretrained(ws.model).float()
    # other padding: float32 round-off only
    want = gradtrace.collect(model, gd.load(_records(), tok, batch_options=BatchOptions(batch_size=2)))
    assert store.ids == want.ids
    rel = (store.read(0, len(store)) - want.vectors).norm(dim=1) / want.vectors.norm(dim=1)
    assert float(rel.max()) < 1e-5
    # every token in the loss: other gradients
    invoke(runner, "collect", ws.model, data, "--out", fresh / "all", "--projection", "none", "--loss-on", "all",
           "--no-progress")
    everything = gradtrace.GradientStore.open(fresh / "all").read(0, 4)
    assert float((everything - want.vectors).norm(dim=1).min()) > 1e-3 * float(want.vectors.norm(dim=1).min())
    config = json.loads((fresh / "s" / "manifest.json").read_text())["config"]
    assert config["data_format"] == "auto" and config["loss_on"] == "auto"


def test_fields_format_parquet_and_split(ws, runner, fresh):
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    renamed = _jsonl(fresh / "renamed.jsonl", _records("question", "answer"))
    common = ["--projection", "none", "--no-progress"]
    line = error_line(invoke(runner, "collect", ws.model, renamed, "--out", fresh / "x", *common, code=2))
    assert "has no 'text' field (it has: answer, id, question)" in line and "--prompt-field" in line
    invoke(runner, "collect", ws.model, renamed, "--out", fresh / "a", "--prompt-field", "question",
           "--completion-field", "answer", "--format", "prompt-completion", *common)
    parquet = fresh / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(_records()), parquet)
    invoke(runner, "collect", ws.model, parquet, "--out", fresh / "b", *common)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_records()),
                          "test": datasets.Dataset.from_list(_records()[:1])}).save_to_disk(str(fresh / "dd"))
    line = error_line(invoke(runner, "collect", ws.model, fresh / "dd", "--out", fresh / "x", *common, code=2))
    assert "splits train, test; choose one with --split" in line
    invoke(runner, "collect", ws.model, fresh / "dd", "--split", "train", "--out", fresh / "c", *common)
    stores = [gradtrace.GradientStore.open(fresh / name) for name in "abc"]
    for other in stores[1:]:
        assert other.ids == stores[0].ids
        torch.testing.assert_close(other.read(0, 4), stores[0].read(0, 4), rtol=0, atol=0)


def test_chat_data_needs_a_chat_template(ws, runner, fresh):
    data = _jsonl(fresh / "chat.jsonl", [{"messages": [{"role": "user", "content": "The king speaks"},
                                                       {"role": "assistant", "content": "fair is foul"}]}])
    line = error_line(invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--no-progress", code=2))
    assert str(data) in line and "no chat template" in line
    assert not (fresh / "s").exists()


def test_bad_data_leaves_the_store_as_it_was(ws, runner, fresh):
    invoke(runner, "collect", ws.model, _jsonl(fresh / "good.jsonl", _records()), "--out", fresh / "s", "--rank", 2,
           "--no-progress")
    before = _tree_digest(fresh / "s")
    bad = _jsonl(fresh / "bad.jsonl", [*_records(), {"id": "q9", "prompt": "Hark:", "completion": " "}])
    line = error_line(invoke(runner, "collect", ws.model, bad, "--out", fresh / "s", "--rank", 2, "--resume",
                             "--no-progress", code=2))
    assert f"{bad} line 5 has an empty 'completion'" in line
    line = error_line(invoke(runner, "collect", ws.model, bad, "--out", fresh / "s", "--rank", 2, "--overwrite",
                             "--no-progress", code=2))
    assert _tree_digest(fresh / "s") == before


def test_score_and_topk_with_prompt_completion_queries(ws, runner, store, fresh):
    queries = _jsonl(fresh / "queries.jsonl", _records())
    out = invoke(runner, "score", store, queries, "--model", ws.model, "--out", fresh / "sc", "--topk", 3,
                 "--no-progress").stdout
    assert "4 examples, prompt-completion, loss on completion" in " ".join(out.split())
    scores = gradtrace.Scores.load(fresh / "sc")
    assert scores.query_ids == [f"q{i}" for i in range(4)]
    shown = invoke(runner, "topk", fresh / "sc", "--queries", queries, "--k", 2, "--format", "json").stdout
    rows = json.loads(shown)
    assert rows[0]["query_text"] == PAIRS[0][0] + PAIRS[0][1]


def test_score_generate_saves_and_shows_the_answers(ws, runner, store, fresh):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = _jsonl(fresh / "prompts.jsonl", [{"id": f"g{i}", "prompt": p} for i, (p, _) in enumerate(PAIRS)])
    args = ["score", store, prompts, "--model", ws.model, "--topk", 3, "--generate", "--max-new-tokens", 5,
            "--no-progress"]
    out = invoke(runner, *args, "--out", fresh / "sc").stdout
    assert "(completions generated by the model)" in " ".join(out.split()) and "answers     4 generated" in out
    scores = gradtrace.Scores.load(fresh / "sc")
    answers = scores.meta["answers"]
    assert sorted(answers) == [f"g{i}" for i in range(4)]
    # the answers are the model's greedy answers, and their gradients are the query gradients
    tok = AutoTokenizer.from_pretrained(ws.model)
    model = AutoModelForCausalLM.from_pretrained(ws.model).float()
    data = gd.load([{"id": f"g{i}", "prompt": p} for i, (p, _) in enumerate(PAIRS)], tok,
                   generate=gd.Generate(model, max_new_tokens=5))
    assert answers == dict(zip(data.ids, data.answers))
    rows = json.loads(invoke(runner, "topk", fresh / "sc", "--k", 2, "--format", "json").stdout)
    assert rows[0]["answer"] == answers[rows[0]["query_id"]]
    table = invoke(runner, "topk", fresh / "sc", "--k", 2, "--queries", prompts, "--width", 200).stdout
    table = " ".join(table.split())
    assert f"query g0: {PAIRS[0][0]}" in table and f"model's answer: {answers['g0'].strip()}" in table
    # sampled answers: the same seed gives the same text
    sampled = [*args, "--temperature", 1.5, "--seed", 4]
    invoke(runner, *sampled, "--out", fresh / "s1")
    invoke(runner, *sampled, "--out", fresh / "s2")
    assert gradtrace.Scores.load(fresh / "s1").meta["answers"] == gradtrace.Scores.load(fresh / "s2").meta["answers"]
