"""The command line's rough edges (issue #29, item 6): --layers/--exclude/--partial on collect, topk's recorded texts,
output not cut at 80 columns (--width), --no-progress everywhere and plain progress lines in logs, a small store's
index, the plan's memory estimate, and a --help that imports no torch."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

import gradtrace
from gradtrace.capture.coverage import recorded_coverage
from gradtrace.cli.main import app
from tests.cli.conftest import error_line, flat, invoke

ROOT = Path(__file__).resolve().parents[2]
EXCLUDED = "transformer.h.1.*"


def _api_params(model_dir: Path, lines: list[str], **layers) -> list[str]:
    """The parameters ``gradtrace.collect`` captures with ``layers`` (a batch of two texts: the selection does not
    depend on the data)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = dict(AutoTokenizer.from_pretrained(model_dir)(lines[:2], return_tensors="pt", padding=True))
    grads = gradtrace.collect(model, [batch], options=gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=4),
                                                                               **layers))
    return [name for name, _ in grads.spec.params]


@pytest.fixture(scope="module")
def excluded(ws, runner, tmp_path_factory):
    """A store collected with ``--exclude`` from a copy of the training data (progress on), and its scores."""
    root = tmp_path_factory.mktemp("polish")
    data = shutil.copy(ws.train, root / "train.jsonl")
    collected = invoke(runner, "collect", ws.model, data, "--out", root / "store", "--rank", 4, "--batch-size", 5,
                       "--exclude", EXCLUDED)
    invoke(runner, "score", root / "store", ws.queries, "--model", ws.model, "--out", root / "scores", "--topk", 3,
           "--no-progress")
    return root, Path(data), collected


# -- 1. --layers / --exclude / --partial --------------------------------------------------------------------------
def test_exclude_captures_what_the_api_captures_and_scores(ws, excluded):
    root, _, _ = excluded
    store = gradtrace.GradientStore.open(root / "store")
    stored = [name for name, _ in store.spec.params]
    assert stored == _api_params(ws.model, ws.lines, exclude=[EXCLUDED])
    assert stored != _api_params(ws.model, ws.lines) and not any(n.startswith("transformer.h.1.") for n in stored)
    recorded = store.manifest["config"]["gradtrace"]["options"]["capture"]
    assert recorded["exclude"] == [EXCLUDED] and recorded["layers"] is None
    scores = gradtrace.Scores.load(root / "scores")  # the queries' gradients captured the store's parameters
    assert list(scores.train_ids) == list(store.ids)


def test_layers_and_tied_exclusions_as_the_api_has_them(ws, runner, fresh):
    patterns = ["*.mlp.*", "transformer.wte"]
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "mlp", "--rank", 4, "--batch-size", 12,
           "--layers", patterns[0], "--layers", patterns[1], "--no-progress")
    stored = [name for name, _ in gradtrace.GradientStore.open(fresh / "mlp").spec.params]
    assert stored == _api_params(ws.model, ws.lines, layers=patterns)
    assert "transformer.wte.weight" in stored and all(".mlp." in n for n in stored if n != "transformer.wte.weight")
    # lm_head shares its weight with transformer.wte (tied): the API refuses to leave it out alone, so does the CLI
    with pytest.raises(ValueError, match=r"shares parameter 'transformer\.wte\.weight'"):
        _api_params(ws.model, ws.lines, exclude=["lm_head"])
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "lm", "--exclude", "lm_head",
                             "--no-progress", code=2))
    assert line.startswith("Error: --exclude: 'lm_head' is excluded but shares parameter 'transformer.wte.weight'")
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "typo", "--exclude", "lm_haed",
                             "--no-progress", code=2))
    assert "--exclude: 'lm_haed' matches no module name; did you mean lm_head?" in line
    assert not (fresh / "lm").exists() and not (fresh / "typo").exists()


@pytest.fixture(scope="module")
def mamba(ws, tmp_path_factory) -> Path:
    """A tiny Mamba (its mixer holds parameters no layer rule captures: A_log, D) with the workspace's tokenizer."""
    import torch
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ws.model)
    out = tmp_path_factory.mktemp("mamba") / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=16, state_size=4, num_hidden_layers=1,
                                 expand=2, conv_kernel=4, pad_token_id=0, bos_token_id=2, eos_token_id=2)
                     ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_an_uncapturable_layer_is_an_error_naming_the_exclude_unless_partial(ws, runner, mamba, fresh):
    line = error_line(invoke(runner, "collect", mamba, ws.train, "--out", fresh / "s", "--rank", 4, "--no-progress",
                             code=2))
    assert "trainable parameter(s) cannot be captured per example" in line and "MambaMixer" in line, line
    fix = re.search(r"leave them out on purpose with ((?:--exclude \S+ ?)+)", line)
    assert fix and "--partial" in line and "% of the trainable parameters" in line, line
    assert not (fresh / "s" / "manifest.json").exists()
    # the --exclude the error names collects, the store recording the share (below 100%: left out by the user)
    excludes = [word.rstrip(",") for word in fix.group(1).split()]
    invoke(runner, "collect", mamba, ws.train, "--out", fresh / "ex", "--rank", 4, *excludes, "--no-progress")
    coverage = recorded_coverage(gradtrace.GradientStore.open(fresh / "ex").manifest)
    assert coverage.share < 1 and {e.reason for e in coverage.left_out} == {"excluded"} and not coverage.partial
    # --partial collects without them, and inspect shows the share
    out = invoke(runner, "collect", mamba, ws.train, "--out", fresh / "p", "--rank", 4, "--partial", "--no-progress")
    partial = recorded_coverage(gradtrace.GradientStore.open(fresh / "p").manifest)
    assert partial.partial and partial.share == coverage.share and {e.reason for e in partial.left_out} == \
        {"unsupported"}
    assert f"coverage {partial.line()}" in " ".join(out.output.split())
    shown = " ".join(invoke(runner, "inspect", fresh / "p").output.split())
    assert f"coverage {partial.line()} (collected with --partial / partial=True)" in shown
    # naming capturable modules only: nothing to refuse
    invoke(runner, "collect", mamba, ws.train, "--out", fresh / "ok", "--rank", 4, "--layers", "*_proj",
           "--no-progress")
    stored = [name for name, _ in gradtrace.GradientStore.open(fresh / "ok").spec.params]
    assert stored and all(name.split(".")[-2].endswith("_proj") for name in stored)


# -- 2. topk reads the recorded data --------------------------------------------------------------------------------
def test_topk_shows_the_recorded_texts_without_data(ws, runner, scores_dir, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in ws.train.read_text().splitlines()}
    rows = json.loads(invoke(runner, "topk", scores_dir, "--k", 2, "--format", "json").stdout)
    assert rows and all(row["train_text"] == texts[row["train_id"]] for row in rows)
    assert all(row["query_text"] for row in rows)  # the query file gradtrace score read
    table = invoke(runner, "topk", scores_dir, "--k", 1, "--width", 200).stdout
    assert "text" in table and texts[rows[0]["train_id"]] in flat(table)


def test_topk_warns_when_the_recorded_data_changed(runner, excluded):
    root, data, _ = excluded
    before = json.loads(invoke(runner, "topk", root / "scores", "--k", 1, "--format", "json").stdout)
    with data.open("a") as handle:  # the file changes after it was collected
        handle.write(json.dumps({"id": "extra", "text": "a line added later"}) + "\n")
    result = invoke(runner, "topk", root / "scores", "--k", 1, "--format", "json")
    assert json.loads(result.stdout) == before  # the same examples, still with their texts
    warning = [line for line in result.stderr.splitlines() if line.startswith("Warning:") and str(data) in line]
    assert len(warning) == 1 and "changed" in warning[0] and "1,565 were recorded" in warning[0]
    data.unlink()  # gone: ids only, nothing to warn about
    rows = json.loads(invoke(runner, "topk", root / "scores", "--k", 1, "--format", "json").stdout)
    assert rows and all("train_text" not in row for row in rows)


# -- 3. output width ------------------------------------------------------------------------------------------------
def test_piped_output_is_not_cut_at_80_columns(ws, runner, scores_dir, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # set, it is honoured as rich does
    rows = json.loads(invoke(runner, "topk", scores_dir, "--k", 3, "--format", "json").stdout)
    long = [f"query {rows[0]['query_id']}: {rows[0]['query_text']}", *(row["train_text"] for row in rows)]
    out = invoke(runner, "topk", scores_dir, "--k", 3, "--width", 200).stdout  # CliRunner: not a terminal
    lines = out.splitlines()
    assert max(map(len, lines)) > 80
    for text in long:
        assert any(text in line for line in lines), text  # whole, on one line
    narrow = invoke(runner, "--width", 60, "topk", scores_dir, "--k", 3, "--width", 200).stdout
    assert max(map(len, narrow.splitlines())) <= 60
    assert invoke(runner, "--width", 10, "topk", scores_dir, code=2).exit_code == 2  # [x>=20]


# -- 4. progress ----------------------------------------------------------------------------------------------------
def test_every_command_accepts_no_progress(runner, store, scores_dir):
    from gradtrace.cli.commands import COMMANDS, flat_fields

    group = typer.main.get_command(app)
    for name, options in COMMANDS.items():
        assert "progress" in {f.name for f in flat_fields(options)}, name
        flags = {o for p in group.commands[name].params for o in (*p.opts, *p.secondary_opts)}
        assert {"--progress", "--no-progress"} <= flags, name
    invoke(runner, "inspect", store, "--no-progress")
    invoke(runner, "self-influence", store, "--top", 2, "--no-progress")
    invoke(runner, "topk", scores_dir, "--k", 1, "--no-progress")


def test_progress_in_a_log_is_plain_lines(excluded):
    _, _, collected = excluded  # collected with progress on, stderr not a terminal
    assert "\r" not in collected.stderr
    lines = [line for line in collected.stderr.splitlines() if line.startswith("collect: ")]
    assert lines[-1].startswith("collect: 5/5 batch (100%)") and "24 examples" in lines[-1]
    assert 2 <= len(lines) <= 6  # a line per tenth at most, not a frame per batch and redraw


def test_line_progress_writes_a_line_per_tenth_and_at_close(monkeypatch):
    import io

    from gradtrace.common import progress

    out = io.StringIO()
    assert list(progress.progress_bar(range(50), desc="work", unit="item", stream=out)) == list(range(50))
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("work: 50/50 item (100%)") and "\r" not in out.getvalue()
    out = io.StringIO()
    bar = progress.progress_bar(total=None, desc="rate", unit="row", stream=out)
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)  # no total: a line every LINE_SECONDS
    bar.update(3)
    bar.set_postfix_str("block 1/2")
    bar.update(4)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("rate: 3 row, ") and lines[-1].startswith("rate: 7 row, ")
    assert lines[-1].endswith("; block 1/2")


# -- 5. index of a small store ---------------------------------------------------------------------------------------
def test_a_small_store_gets_a_flat_index_and_says_why(runner, store, fresh):
    pytest.importorskip("faiss")
    out = flat(invoke(runner, "index", store, "--out", fresh / "i", "--no-progress").stdout)
    info = json.loads((fresh / "i" / "index.json").read_text())
    assert info["params"]["kind"] == "flat" and "24 rows, fewer than 10,000" in info["meta"]["auto_kind"]
    assert "kind flat, chosen by --kind auto: 24 rows, fewer than 10,000" in out
    invoke(runner, "index", store, "--out", fresh / "j", "--nlist", 1, "--nbits", 4, "--no-progress")  # ivfpq asked
    assert json.loads((fresh / "j" / "index.json").read_text())["params"]["kind"] == "ivfpq"


def test_faiss_training_warnings_are_said_once(runner, store, fresh, capfd):
    pytest.importorskip("faiss")
    result = invoke(runner, "index", store, "--out", fresh / "pq", "--kind", "ivfpq", "--nbits", 4, "--no-progress")
    said = [line for line in result.stderr.splitlines() if "FAISS" in line]
    assert len(said) == 1 and said[0].startswith("Warning: FAISS warned 9 times while training the IVF1,PQ8x4 index")
    assert "(x8)" in said[0]
    assert "WARNING clustering" not in capfd.readouterr().err  # FAISS's own lines, on descriptor 2: none left


# -- 6. memory estimate ---------------------------------------------------------------------------------------------
def test_the_plan_shows_the_memory_estimate(ws, excluded):
    from transformers import AutoModelForCausalLM

    from gradtrace.capture.memory import estimate_step_memory
    from gradtrace.cli.console import human_bytes

    root, _, collected = excluded
    line = next(line for line in collected.stdout.splitlines() if line.startswith("  memory "))
    batch, length = map(int, re.search(r"at batch (\d+) x (\d+) tokens", line).groups())
    assert batch == 5
    dim = gradtrace.GradientStore.open(root / "store").dim
    estimate = estimate_step_memory(AutoModelForCausalLM.from_pretrained(ws.model), batch, length, dim)
    assert f"about {human_bytes(estimate.total)} per step" in line
    assert f"(model weights {human_bytes(estimate.weights)} besides)" in line
    plan = collected.stdout[collected.stdout.index("Plan:"):]
    assert plan.index("  store ") < plan.index("  memory ") < plan.index("  time ")


def test_the_plan_memory_estimate_matches_a_measured_peak():
    """The estimate against the peak RSS of one capture step (a fresh process: bench/collect_memory.py) for the
    GPT-2 of these tests at 256 x 48 tokens (about 180 MiB): within 25 %."""
    spec = importlib.util.spec_from_file_location("collect_memory", ROOT / "bench" / "collect_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    case = bench.CASES[0]
    assert (case["hidden"], case["layers"], case["vocab"]) == (32, 2, 320)  # conftest's GPT-2
    result = bench.measure(case)
    assert 0.75 <= result["estimate"] / result["measured"] <= 1.25, result


# -- 7. --help without torch ----------------------------------------------------------------------------------------
HELP = """
import sys
import typer
from gradtrace.cli.main import app
group = typer.main.get_command(app)
for args in [["--help"], *([name, "--help"] for name in group.commands)]:
    try:
        group.main(args, prog_name="gradtrace", standalone_mode=False)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "transformers", "numpy", "faiss") if m in sys.modules))
"""


def test_help_imports_no_torch():
    result = subprocess.run([sys.executable, "-m", "gradtrace.cli", "--help"], capture_output=True, text=True,
                            cwd=ROOT, check=True)
    assert "Usage: gradtrace" in result.stdout
    check = subprocess.run([sys.executable, "-X", "importtime", "-m", "gradtrace.cli", "--help"], capture_output=True,
                           text=True, cwd=ROOT, check=True)
    imported = {line.split("|")[-1].strip() for line in check.stderr.splitlines() if line.startswith("import time:")}
    assert "gradtrace.cli.main" in imported and "torch" not in imported and "transformers" not in imported
    every = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, cwd=ROOT, check=True)
    assert every.stdout.strip().splitlines()[-1] == "[]"  # no command's --help imports them either


def test_the_method_choices_are_the_registry_s():
    from gradtrace.cli.method_choice import CLI_METHODS, PYTHON_METHODS
    from gradtrace.fit.methods import available_methods, method_class

    assert {name: method_class(name).description for name in CLI_METHODS} == CLI_METHODS
    assert sorted(available_methods()) == sorted([*CLI_METHODS, *PYTHON_METHODS])
