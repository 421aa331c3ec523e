"""``gradtrace collect`` stopped by SIGTERM: rows so far committed, one line saying so, ``--resume`` finishes it
bit-exact; shard sizes in bytes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from gradtrace.store import GradientStore
from tests.cli.conftest import error_line, invoke

ROOT = Path(__file__).resolve().parents[2]

# the real CLI in a subprocess whose data sends the process SIGTERM when batch KILL_AT is asked for (the plan's
# warm-up runs the first 2 batches through run_capture too: KILL_AT must be larger)
SIGTERM_AT_BATCH = """
import os, signal, sys
import importlib
collect_module = importlib.import_module("gradtrace.capture.collect")
real = collect_module.run_capture
def run_capture(model, data, *args, **kwargs):
    def batches():
        for step, batch in enumerate(data):
            if step == int(os.environ["KILL_AT"]):
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch
    return real(model, batches(), *args, **kwargs)
collect_module.run_capture = run_capture
from gradtrace.cli.main import app
app(sys.argv[1:], prog_name="gradtrace")
"""


def _stored(path: Path) -> dict[str, torch.Tensor]:
    store = GradientStore.open(path)
    vectors = store.read(0, len(store))
    return {ident: vectors[row] for row, ident in enumerate(store.ids)}


def test_sigterm_commits_the_first_shard_and_resume_finishes_bit_exact(ws, runner, fresh):
    args = ["collect", ws.model, ws.train, "--rank", 4, "--batch-size", 2, "--dtype", "int8", "--no-progress"]
    out = fresh / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_AT": "3"}
    killed = subprocess.run([sys.executable, "-c", SIGTERM_AT_BATCH, *map(str, args), "--out", str(out)], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr
    lines = [line for line in killed.stderr.splitlines() if line.startswith("Error: ")]
    assert lines == [f"Error: interrupted by SIGTERM: 6 rows are committed in {out} (marked interrupted); run the "
                     "same command with --resume to finish it"], killed.stderr
    assert "Traceback" not in killed.stderr
    assert GradientStore.open(out, allow_incomplete=True).ids == [f"t{i}" for i in range(6)]

    invoke(runner, *args, "--out", out, "--resume")
    invoke(runner, *args, "--out", fresh / "full")
    got, want = _stored(out), _stored(fresh / "full")
    assert sorted(got) == sorted(want) and all(torch.equal(got[i], want[i]) for i in want)


def test_shard_bytes_sizes_the_shards(ws, runner, store, fresh):
    per_row = GradientStore.open(store).dim + 4  # the same capture (rank 4) in int8: values and a float32 scale
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4, "--no-progress",
           "--dtype", "int8", "--shard-bytes", 5 * per_row + 3)
    written = GradientStore.open(fresh / "s")
    assert [s.rows for s in written.shards] == [5, 5, 5, 5, 4]
    assert (fresh / "s" / "shards" / "r00000-000000.data").stat().st_size == 5 * (per_row - 4)


def test_shard_options_are_refused_together_or_below_one_row(ws, runner, fresh):
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "a", "--shard-rows", 4,
                             "--shard-bytes", 4096, code=2))
    assert line == "Error: --shard-rows and --shard-bytes both size the shards; pass one of them"
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "b", "--rank", 4, "--dtype",
                             "int8", "--shard-bytes", 10, "--no-progress", code=2))
    assert "--shard-bytes 10 is smaller than one row of this store (" in line and "values in int8)" in line


def test_dry_run_prints_the_plan_and_writes_nothing(ws, runner, store, fresh):
    result = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4, "--dry-run",
                    "--no-progress")
    dim = GradientStore.open(store).dim
    assert "Plan: 24 examples" in result.stdout and f"per example {dim:,} dims" in result.stdout
    assert not (fresh / "s").exists()


def test_a_store_larger_than_the_free_disk_is_refused_unless_forced(ws, runner, fresh, monkeypatch):
    plan_module = sys.modules["gradtrace.plan.collect_plan"]
    monkeypatch.setattr(plan_module, "free_space", lambda path: 1000)
    line = error_line(invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4,
                             "--no-progress", code=2))
    assert line.startswith("Error: the store needs about ") and "has 1000 B free" in line and "--force" in line
    assert not (fresh / "s").exists()
    invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--rank", 4, "--no-progress", "--force")
    assert len(GradientStore.open(fresh / "s")) == 24
