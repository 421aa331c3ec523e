"""``gradtrace score`` runs unchanged under ``torchrun --nproc_per_node 2`` and saves what one process saves.

The test builds a tiny GPT-2 model directory and a LoGra store of 9 training texts (an uneven 4 + 5 split),
scores 3 queries in this process (the reference) and again with ``torchrun --standalone`` (gloo on CPU):
rank 0 writes the outputs and prints the summary once; the top-k and the matrix equal the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradtrace import Scores
from tests.cli.conftest import _gpt2, _tokenizer, corpus_lines, invoke

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from typer.testing import CliRunner

    root = tmp_path_factory.mktemp("torchrun")
    lines = corpus_lines(120)
    tokenizer = _tokenizer(lines)
    model = root / "model"
    _gpt2(len(tokenizer), seed=0).save_pretrained(model)
    tokenizer.save_pretrained(model)
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(lines[:9])))
    queries = root / "queries.txt"
    queries.write_text("\n".join(lines[100:103]) + "\n")
    runner = CliRunner()
    store = root / "store"
    invoke(runner, "collect", model, train, "--out", store, "--rank", 4, "--batch-size", 4, "--no-progress")
    reference = root / "reference"
    invoke(runner, "score", store, queries, "--model", model, "--out", reference, "--topk", 3, "--matrix", "yes",
           "--no-progress")
    return root, model, store, queries, reference


def _torchrun(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "gradtrace.cli", *map(str, args)]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_gradtrace_score_under_torchrun_equals_one_process(workspace):
    root, model, store, queries, reference = workspace
    out = root / "scores-2-ranks"
    started = time.monotonic()
    done = _torchrun("score", store, queries, "--model", model, "--out", out, "--topk", 3, "--matrix", "yes",
                     "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 45
    assert done.stdout.count("Scored 3 queries against 9 training examples with grad_dot") == 1, done.stdout
    assert "ranks       2 (training rows per rank: 4, 5); outputs written by rank 0" in done.stdout

    got, want = Scores.load(out), Scores.load(reference)
    assert got.train_ids == want.train_ids and got.query_ids == want.query_ids
    torch.testing.assert_close(got.matrix, want.matrix, rtol=1e-5, atol=1e-6)
    for mine, theirs in ((got.top, want.top), (got.bottom, want.bottom)):
        assert torch.equal(mine[1], theirs[1])
        torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert got.meta["distributed"]["rows"] == [4, 5]


def test_gradtrace_score_under_torchrun_reports_bad_input_on_every_rank(workspace):
    root, model, store, queries, _ = workspace
    (root / "not-a-dir").write_text("")
    done = _torchrun("score", store, queries, "--model", model, "--out", root / "not-a-dir", "--no-progress")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == [f"Error: --out {root / 'not-a-dir'} exists and is not a directory"] * 2, done.stderr
