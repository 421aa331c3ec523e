"""collect -> inspect -> score -> topk end to end, checked against the Python API."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

import gradtrace
from gradtrace.common.provenance import resolve_paths
from gradtrace.options import CaptureOptions
from tests.cli.conftest import error_line, invoke


def _api_batches(ws, texts, ids, batch_size):
    """The reference the CLI is checked against: the tokenizer's own right-padded batches, without gradtrace.data."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ws.model), local_files_only=True)
    tokenizer.padding_side = "right"
    batches = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], padding=True, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                        "id": list(ids[start:start + batch_size])})
    return batches


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def test_collect_writes_store_config_and_manifest(ws, store):
    opened = gradtrace.GradientStore.open(store)
    assert opened.ids == [f"t{i}" for i in range(24)]
    assert opened.spec.projection["kind"] == "logra" and opened.spec.projection["rank_rows"] == 4
    resolved = yaml.safe_load((store / "gradtrace-collect.yaml").read_text())
    assert resolved["gradtrace"]["command"] == "collect"
    assert resolved["gradtrace"]["version"] == gradtrace.__version__
    assert resolved["rank"] == 4 and resolved["batch_size"] == 5 and resolved["projection"] == "logra"
    assert resolved["max_length"] == 48  # resolved from the model's context
    assert resolved["device"] == "cpu"  # "auto" resolved
    # the saved config and the manifest: paths relative to the store's folder (beside the model and data), read
    # back against it; the manifest also keeps the folder it was written in, and the same values otherwise
    assert (resolved["model"], resolved["data"], resolved["out"]) == ("../model", "../train.jsonl", ".")
    manifest_config = opened.manifest["config"]
    assert (manifest_config["model"], manifest_config["data"], manifest_config["out"]) == \
        ("../model", "../train.jsonl", ".")
    assert manifest_config["gradtrace"]["data"]["path"] == "../train.jsonl"
    assert manifest_config["recorded_in"] == str(store.resolve())
    back = resolve_paths(manifest_config, store)
    assert Path(back["model"]) == ws.model.absolute() and Path(back["data"]) == ws.train.absolute()
    paths = {"model", "data", "out", "gradtrace", "provenance", "recorded_in"}
    assert {k: v for k, v in manifest_config.items() if k not in paths} == \
        {k: v for k, v in resolved.items() if k not in paths}


def test_collect_matches_python_api(ws, store):
    records = [json.loads(line) for line in ws.train.read_text().splitlines()]
    batches = _api_batches(ws, [r["text"] for r in records], [r["id"] for r in records], 3)
    expected = gradtrace.collect(_model(ws.model), batches,
                                 options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    stored = gradtrace.GradientStore.open(store)
    assert stored.ids == expected.ids
    torch.testing.assert_close(stored.read(0, len(stored)), expected.vectors, rtol=1e-4, atol=1e-6)


def test_content_hash_ids_match_library(ws, runner, fresh):
    invoke(runner, "collect", ws.model, ws.train_noid, "--out", fresh / "s", "--rank", 2, "--no-progress")
    texts = [json.loads(line)["text"] for line in ws.train_noid.read_text().splitlines()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, texts, ["x"] * len(texts), 8)]
    expected = gradtrace.collect(_model(ws.model), batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    assert gradtrace.GradientStore.open(fresh / "s").ids == expected.ids


def test_inspect_store(store, runner):
    result = invoke(runner, "inspect", store, "--json", "--verify")
    info = json.loads(result.stdout)
    assert info["kind"] == "gradient store" and info["rows"] == 24 and info["complete"] is True
    assert info["dtype"] == "float32" and info["projection"]["kind"] == "logra"
    assert info["config"]["rank"] == 4 and info["checksums_verified"] is True
    assert sum(info["param_dims"].values()) == info["dim"]
    table = invoke(runner, "inspect", store).stdout
    for word in ("rows", "24", "LoGra rank 4x4", "GPT2LMHeadModel", "config.rank"):
        assert word in table


def test_inspect_says_who_wrote_a_store_of_the_python_api(ws, runner, fresh):
    """A store of ``gradtrace.collect`` records its options but no command line: inspect says so (not "None")."""
    texts = [json.loads(line)["text"] for line in ws.train.read_text().splitlines()][:6]
    gradtrace.collect(_model(ws.model), _api_batches(ws, texts, [f"r{i}" for i in range(6)], 3), store=fresh / "api")
    table = invoke(runner, "inspect", fresh / "api").stdout
    line = next(row for row in table.splitlines() if row.startswith("written by"))
    assert "Python API" in line and "None" not in line


def test_score_matches_python_api(ws, store, scores_dir):
    scores = gradtrace.Scores.load(scores_dir)
    queries = [line for line in ws.queries.read_text().splitlines() if line.strip()]
    batches = [{k: v for k, v in b.items() if k != "id"} for b in _api_batches(ws, queries, ["x"] * 3, 8)]
    query_set = gradtrace.collect(_model(ws.model), batches,
                                  options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    expected = gradtrace.Attributor("grad_dot", train=gradtrace.GradientStore.open(store)).score(query_set, topk=5)
    assert scores.query_ids == expected.query_ids and scores.train_ids == expected.train_ids
    torch.testing.assert_close(scores.matrix, expected.matrix, rtol=1e-4, atol=1e-3)
    resolved = yaml.safe_load((scores_dir / "gradtrace-score.yaml").read_text())
    assert resolved["method"] == "grad_dot" and resolved["topk"] == 5 and resolved["store"] == "../store"
    assert scores.meta["config"]["method"] == "grad_dot"


def test_inspect_scores(scores_dir, runner):
    info = json.loads(invoke(runner, "inspect", scores_dir, "--json").stdout)
    assert info["kind"] == "scores" and info["method"] == "grad_dot"
    assert (info["queries"], info["train"]) == (3, 24) and info["matrix"] is True and info["top_k"] == 5
    assert "helps the query" in info["meta"]["sign"]
    assert "3 queries x 24 training examples" in invoke(runner, "inspect", scores_dir).stdout


def test_topk_table_with_text(ws, scores_dir, runner):
    out = invoke(runner, "topk", scores_dir, "--k", 3, "--data", ws.train, "--queries", ws.queries,
                 "--width", 200).stdout
    assert "positive score = the training example helps the query" in out
    scores = gradtrace.Scores.load(scores_dir)
    best = scores.topk(1).ids[0][0]
    text = json.loads(ws.train.read_text().splitlines()[int(best[1:])])["text"]
    assert best in out and " ".join(text.split())[:30] in out
    assert " ".join(ws.queries.read_text().splitlines()[0].split())[:30] in out  # query text via content hashes


def test_topk_csv_json_and_filters(scores_dir, runner, ws):
    scores = gradtrace.Scores.load(scores_dir)
    query = scores.query_ids[1]
    rows = list(csv.DictReader(io.StringIO(invoke(runner, "topk", scores_dir, "-k", 2, "--query", query,
                                                  "--format", "csv").stdout)))
    assert [r["query_id"] for r in rows] == [query, query] and [r["rank"] for r in rows] == ["1", "2"]
    top = scores.topk(2)
    assert [r["train_id"] for r in rows] == top.ids[1]
    bottom = json.loads(invoke(runner, "topk", scores_dir, "-k", 2, "--bottom", "--format", "json",
                               "--data", ws.train).stdout)
    assert [r["train_id"] for r in bottom[:2]] == scores.topk(2, largest=False).ids[0]
    assert all(r["train_text"] for r in bottom)


def test_topk_text_of_content_hash_ids(ws, runner, fresh):
    """--data without ids: the ids are recomputed with the tokenizer recorded by collect."""
    invoke(runner, "collect", ws.model, ws.train_noid, "--out", fresh / "s", "--rank", 2, "--no-progress")
    invoke(runner, "score", fresh / "s", ws.queries, "--out", fresh / "sc", "--no-progress")  # model from the store
    out = json.loads(invoke(runner, "topk", fresh / "sc", "-k", 24, "--data", ws.train_noid, "--format",
                            "json").stdout)
    assert len(out) == 72 and all(r["train_text"] for r in out)


@pytest.mark.parametrize("suffix", [".csv", ".json", ".parquet"])
def test_score_exports(ws, store, runner, fresh, suffix):
    target = fresh / f"top{suffix}"
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", fresh / "sc", "--topk", 4,
           "--export", target, "--no-progress")
    if suffix == ".csv":
        rows = list(csv.DictReader(target.open()))
    elif suffix == ".json":
        rows = json.loads(target.read_text())["scores"]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(target).to_pylist()
    assert len(rows) == 12 and {r["query_id"] for r in rows} == set(gradtrace.Scores.load(fresh / "sc").query_ids)


def test_unprojected_int8_store_and_topk_only_scores(ws, runner, fresh):
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--projection", "none", "--dtype", "int8",
           "--no-progress")
    opened = gradtrace.GradientStore.open(fresh / "s")
    assert opened.spec.projection is None and opened.spec.dtype == "int8"
    invoke(runner, "score", fresh / "s", ws.queries, "--out", fresh / "sc", "--matrix", "no", "--topk", 3,
           "--method", "grad_cos", "--no-progress")
    scores = gradtrace.Scores.load(fresh / "sc")
    assert scores.matrix is None and scores.top[0].shape == (3, 3) and scores.method == "grad_cos"
    assert scores.top[0].abs().max() <= 1.0 + 1e-5
    line = error_line(invoke(runner, "topk", fresh / "sc", "--k", 5, code=2))
    assert "only the top 3" in line


def test_resume_adds_only_missing_examples(ws, runner, fresh):
    half = fresh / "half.jsonl"
    half.write_text("".join(ws.train.read_text().splitlines(keepends=True)[:10]))
    invoke(runner, "collect", ws.model, half, "--out", fresh / "s", "--rank", 4, "--no-progress")
    assert len(gradtrace.GradientStore.open(fresh / "s")) == 10
    out = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4, "--resume",
                 "--no-progress").stdout
    assert "Stored 14 new examples (10 were already stored)" in " ".join(out.split())
    opened = gradtrace.GradientStore.open(fresh / "s")
    assert sorted(opened.ids) == sorted(f"t{i}" for i in range(24))
    saved = yaml.safe_load((fresh / "s" / "gradtrace-collect.yaml").read_text())
    assert saved["resume"] is False  # the header's commands say --overwrite / --resume


def test_overwrite_replaces_store(ws, runner, fresh):
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 2, "--no-progress")
    invoke(runner, "collect", ws.model, ws.queries, "--out", fresh / "s", "--rank", 2, "--overwrite", "--no-progress")
    assert len(gradtrace.GradientStore.open(fresh / "s")) == 3


def test_truncate(ws, runner, fresh):
    long = fresh / "long.txt"
    long.write_text(" ".join(ws.lines[:30]) + "\n" + ws.lines[0] + "\n")
    invoke(runner, "collect", ws.model, long, "--out", fresh / "s", "--truncate", "--max-length", 16,
           "--rank", 2, "--no-progress")
    assert len(gradtrace.GradientStore.open(fresh / "s")) == 2


def test_progress_bar_and_profile(ws, runner, fresh):
    out = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 2).output
    assert "collect" in out and "batch/s" in out and "Where the time went" in out and "examples/s" in out


def test_per_parameter_ranks_collect_and_score(ws, runner, fresh):
    """--ranks GLOB=ROWSxCOLS reaches the store's projection spec; score rebuilds it for the queries."""
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 2, "--ranks", "*wte.weight=320x3",
           "--no-progress")
    records = [json.loads(line) for line in ws.train.read_text().splitlines()]
    batches = _api_batches(ws, [r["text"] for r in records], [r["id"] for r in records], 3)
    logra = gradtrace.LoGra(rank=2, seed=0, ranks={"*wte.weight": (320, 3)})
    expected = gradtrace.collect(_model(ws.model), batches, options=CaptureOptions(projection=logra))
    stored = gradtrace.GradientStore.open(fresh / "s")
    assert stored.spec.projection == logra.to_dict() and dict(stored.spec.params)["transformer.wte.weight"] == 960
    torch.testing.assert_close(stored.read(0, len(stored)), expected.vectors, rtol=1e-4, atol=1e-6)
    invoke(runner, "score", fresh / "s", ws.queries, "--out", fresh / "sc", "--no-progress")
    assert len(gradtrace.Scores.load(fresh / "sc").query_ids) == 3
    message = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "t", "--ranks", "*wte=big",
                                "--no-progress", code=2))
    assert "--ranks: expected GLOB=ROWSxCOLS or GLOB=RANK, got '*wte=big'" in message
