"""Bad input: one clear line (no traceback) and exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest

from gradtrace.store.layout import manifest_checksum
from tests.cli.conftest import copy_store, error_line, flat, invoke


def test_collect_input_errors(ws, runner, fresh):
    out = ["--out", fresh / "s", "--no-progress"]
    cases = [
        ((fresh / "nope", ws.train), "model directory"),
        ((ws.no_tokenizer, ws.train), "has no tokenizer"),
        ((ws.train, ws.train), "is not a directory"),
        ((fresh, ws.train), "no config.json"),
        ((ws.model, fresh / "missing.jsonl"), "does not exist"),
        ((ws.model, ws.model), "is a directory"),
    ]
    for args, message in cases:
        assert message in error_line(invoke(runner, "collect", *args, *out, code=2))
    assert not (fresh / "s").exists()


@pytest.mark.parametrize(("content", "name", "message"), [
    ("", "empty.jsonl", "holds no examples"),
    ("\n\n", "blank.txt", "holds no examples"),
    ('{"text": "a fine line"}\n{"text": oops}\n', "bad.jsonl", "line 2 is not valid JSON"),
    ('{"text": "a fine line"}\n["a list"]\n', "list.jsonl", "line 2 is a JSON list"),
    ('{"body": "no text field"}\n', "field.jsonl", "line 1 has no 'text' field (it has: body)"),
    ('{"text": 3}\n', "type.jsonl", "'text' is a int, not a string"),
    ('{"id": 1, "text": "one"}\n{"text": "two"}\n', "mixed.jsonl", "line 1 has an 'id' field but line 2 has none"),
    ('{"id": 1, "text": "one"}\n{"id": 1, "text": "two"}\n', "dup.jsonl", "id '1' appears on lines 1 and 2"),
    ('{"text": ""}\n', "emptytext.jsonl", "line 1 has no tokens"),
    ("a,b\n", "data.xlsx", "unknown format '.xlsx'"),  # CSV is read since issue 13: an unknown suffix instead
    ("a,b\n", "header.csv", "holds no examples"),
])
def test_bad_datasets(ws, runner, fresh, content, name, message):
    data = fresh / name
    data.write_text(content)
    line = error_line(invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--no-progress", code=2))
    assert message in line and str(data) in line


def test_too_long_example_names_its_line(ws, runner, fresh):
    data = fresh / "long.jsonl"
    rows = [{"id": "short", "text": "Fair is foul."}, {"id": "long", "text": " ".join(ws.lines[:20])},
            {"id": "long2", "text": " ".join(ws.lines[20:40])}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = error_line(invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--max-length", 20, code=2))
    assert "line 2 (id 'long')" in line and "more than --max-length 20" in line and "1 more" in line
    assert "--truncate" in line
    # default limit: the model's context
    line = error_line(invoke(runner, "collect", ws.model, data, "--out", fresh / "s", code=2))
    assert "--max-length 48" in line
    line = error_line(invoke(runner, "collect", ws.model, data, "--out", fresh / "s", "--max-length", 500, code=2))
    assert "longer than the model's context (48 tokens)" in line


def test_store_target_errors(ws, runner, store, fresh):
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", store, code=2))
    assert "already holds a gradient store" in line and "--resume" in line and "--overwrite" in line
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", store, "--resume", "--overwrite",
                             code=2))
    assert "contradict" in line
    (fresh / "junk").mkdir()
    (fresh / "junk" / "notes.txt").write_text("mine")
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "junk", "--no-progress", code=2))
    assert "is not empty and is not a gradient store" in line
    assert (fresh / "junk" / "notes.txt").read_text() == "mine"


def test_resume_with_other_settings_is_refused(ws, runner, store, fresh):
    """Even when every example is already stored (nothing would be written)."""
    copy = copy_store(store, fresh / "s")
    before = (copy / "gradtrace-collect.yaml").read_text()
    for args, message in [(("--rank", 8), "LoGra rank 8x8"), (("--projection", "none"), "none (exact gradients)"),
                          (("--dtype", "int8"), "stores float32"), (("--seed", 1), "seed 1")]:
        line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", copy, "--resume", "--rank", 4, *args,
                                 "--no-progress", code=2))
        assert "--overwrite" in line and message in line
    line = error_line(invoke(runner, "collect", ws.other_arch, ws.train, "--out", copy, "--resume", "--rank", 4,
                             "--no-progress", code=2))
    assert "another model" in line
    # a second checkpoint of the same model (other weights) would mix rows of two models: refused, exit 2
    line = error_line(invoke(runner, "collect", ws.model2, ws.train, "--out", copy, "--resume", "--rank", 4,
                             "--no-progress", code=2))
    assert f"cannot --resume {copy}: it was collected with other model weights (fingerprint" in line
    assert "--overwrite" in line
    assert (copy / "gradtrace-collect.yaml").read_text() == before


def test_score_input_errors(ws, runner, store, scores_dir, fresh):
    out = ["--out", fresh / "sc", "--no-progress"]
    line = error_line(invoke(runner, "score", fresh / "nope", ws.queries, *out, code=2))
    assert "store" in line and "does not exist" in line
    line = error_line(invoke(runner, "score", ws.root, ws.queries, *out, code=2))
    assert "is not a gradient store" in line
    line = error_line(invoke(runner, "score", store, fresh / "q.jsonl", *out, code=2))
    assert "queries file" in line and "does not exist" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--model", ws.no_tokenizer, *out, code=2))
    assert "has no tokenizer" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--out", scores_dir, code=2))
    assert "already holds scores" in line and "--overwrite" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--out", store, code=2))
    assert "is a gradient store" in line
    line = error_line(invoke(runner, "score", store, ws.queries, *out, "--export", fresh / "x.xlsx", code=2))
    assert "'.xlsx'" in line
    line = error_line(invoke(runner, "score", store, ws.queries, *out, "--topk", 0, "--matrix", "no", code=2))
    assert "neither the matrix nor a top-k" in line
    assert not (fresh / "sc").exists()


def test_unknown_method(ws, runner, store, fresh):
    result = invoke(runner, "score", store, ws.queries, "--out", fresh / "sc", "--method", "magic", code=2)
    assert "Traceback" not in result.output
    text = flat(result.output)
    assert "'magic' is not one of" in text and "'grad_dot'" in text and "'tracin'" in text


def test_store_and_model_mismatch(ws, runner, store, fresh):
    line = error_line(invoke(runner, "score", store, ws.queries, "--model", ws.other_arch, "--out", fresh / "sc",
                             "--no-progress", code=2))
    assert "another model" in line and str(store) in line


def test_unreproducible_projection_is_refused(ws, runner, store, fresh):
    copy = copy_store(store, fresh / "s")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["spec"]["projection"] = {"kind": "sjlt", "seed": 0, "dim": 64}
    manifest["checksum"] = manifest_checksum(manifest)  # a store written so, not an edited one
    (copy / "manifest.json").write_text(json.dumps(manifest))
    line = error_line(invoke(runner, "score", copy, ws.queries, "--model", ws.model, "--out", fresh / "sc", code=2))
    assert "'sjlt' projection" in line and "LoGra projections only" in line


def test_store_without_recorded_model_needs_model(ws, runner, store, fresh):
    copy = copy_store(store, fresh / "s")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["config"] = {}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    line = error_line(invoke(runner, "score", copy, ws.queries, "--out", fresh / "sc", code=2))
    assert "does not record the model" in line and "--model" in line


def test_incomplete_store_is_refused_by_score_but_inspectable(ws, runner, store, fresh):
    copy = copy_store(store, fresh / "s")
    status = json.loads((copy / "rank-00000.json").read_text())
    (copy / "rank-00000.json").write_text(json.dumps({**status, "status": "interrupted"}))
    line = error_line(invoke(runner, "score", copy, ws.queries, "--out", fresh / "sc", code=2))
    assert "incomplete" in line
    info = json.loads(invoke(runner, "inspect", copy, "--json").stdout)
    assert info["complete"] is False and info["ranks"] == {"0": "interrupted"}


def test_tracin_option_errors(ws, runner, store, fresh):
    out = ["--out", fresh / "sc", "--no-progress"]
    # --store with a single-checkpoint method is an ensemble (tests/cli/test_ensemble_cli.py); its flags are checked
    line = error_line(invoke(runner, "score", store, ws.queries, "--store", store, "--ensemble-weights", 1, *out,
                             code=2))
    assert "1 --ensemble-weights for 2 stores" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--lr", 0.1, *out, code=2))
    assert "--lr" in line and "grad_dot" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--method", "tracin", "--store", store, "--lr", 0.1,
                             *out, code=2))
    assert "one --lr per checkpoint: got 1 for 2 stores" in line
    line = error_line(invoke(runner, "score", store, ws.queries, "--method", "tracin", "--store", store, "--lr", 0.1,
                             "--lr", 0.2, "--model", ws.model, *out, code=2))
    assert "1 --model for 2 stores" in line


def test_topk_and_inspect_errors(ws, runner, scores_dir, fresh):
    assert "does not exist" in error_line(invoke(runner, "topk", fresh / "nope", code=2))
    assert "holds no saved scores" in error_line(invoke(runner, "topk", ws.root, code=2))
    line = error_line(invoke(runner, "topk", scores_dir, "--query", "q-unknown", code=2))
    assert "'q-unknown'" in line
    assert "does not exist" in error_line(invoke(runner, "inspect", fresh / "nope", code=2))
    assert "neither a gradient store" in error_line(invoke(runner, "inspect", ws.root, code=2))
    broken = fresh / "broken"
    shutil.copytree(scores_dir, broken)
    (broken / "scores.json").write_text("{}")
    assert "not a gradtrace score file" in error_line(invoke(runner, "topk", broken, code=2))


def test_debug_env_shows_traceback(ws, runner, fresh, monkeypatch):
    monkeypatch.setenv("GRADTRACE_DEBUG", "1")
    result = runner.invoke(__import__("gradtrace.cli", fromlist=["app"]).app,
                           ["collect", str(ws.model), str(fresh / "missing.jsonl"), "--out", str(fresh / "s")])
    assert result.exit_code != 0 and result.exception is not None and not isinstance(result.exception, SystemExit)


def test_unwritable_output_directory_is_refused_before_model_work(ws, runner, fresh, monkeypatch):
    """A --out that cannot be written: one line naming the directory, before the model is loaded; nothing left."""
    import gradtrace.cli.collect as collect_cli

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(collect_cli, "load_model", never)
    (fresh / "afile").write_text("mine")
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "afile" / "store", code=2))
    assert f"--out {fresh / 'afile' / 'store'}: {fresh / 'afile'} is a file, not a directory (ENOTDIR)" in line
    assert "choose another --out" in line and (fresh / "afile").read_text() == "mine"
    readonly = fresh / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        import tempfile

        try:  # root ignores permissions: check that this directory really refuses a file
            tempfile.TemporaryFile(dir=readonly).close()
        except PermissionError:
            line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", readonly / "s", code=2))
            assert f"{readonly} is not writable (Permission denied)" in line
    finally:
        readonly.chmod(0o700)
    assert list(readonly.iterdir()) == []


def test_shard_bytes_smaller_than_one_row_names_the_row_size(ws, runner, store, fresh):
    """Refused after the plan (which knows the row size), before any gradient; no store is written."""
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4,
                             "--shard-bytes", 100, "--no-progress", code=2))
    from gradtrace.store import GradientStore
    from gradtrace.store.shards import row_bytes

    dim = GradientStore.open(store).dim  # the same data and rank 4
    one = row_bytes(dim, "float32")
    assert f"--shard-bytes 100 is smaller than one row of this store ({one:,} bytes: {dim:,} values in float32); " \
           f"pass --shard-bytes {one:,} or more" in line
    assert not (fresh / "s" / "manifest.json").exists()
