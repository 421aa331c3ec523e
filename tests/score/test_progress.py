"""Progress bars: scoring counts the training rows block by block (a store smaller than one block no longer sits
at ``0/1``) and collect over a generator shows its rate (the command's query bar: tests/cli/test_preflight.py), as a
tqdm bar on a terminal and as plain lines elsewhere (gradtrace.common.progress; here stderr is captured, not a
terminal, so the plain lines are what the tests read unless they say otherwise)."""

from __future__ import annotations

import torch

import gradtrace
from gradtrace.options import RunOptions
from tests import tiny


def _mlp_batches(n: int, batch: int = 4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 7, generator=g), torch.randint(0, 4, (n,), generator=g)
    return [(x[s:s + batch], y[s:s + batch]) for s in range(0, n, batch)]


def _last_frame(err: str, label: str) -> str:
    """The last state a tqdm bar labelled ``label`` drew (frames are separated by carriage returns)."""
    frames = [f for f in err.replace("\n", "\r").split("\r") if f.startswith(label + ":")]
    assert frames, err
    return frames[-1]


def test_score_bar_counts_rows_and_blocks(capsys):
    torch.manual_seed(0)
    model = tiny.MLP()
    train = gradtrace.collect(model, _mlp_batches(10))
    gradtrace.Attributor("grad_dot", train, block_rows=4).score(train, topk=2, progress=True)
    last = _last_frame(capsys.readouterr().err, "score")
    assert "10/10" in last and "block 3/3" in last and "row/s" in last  # 10 rows in blocks of 4, 4, 2
    gradtrace.Attributor("grad_dot", train).score(train, topk=2, progress=True)  # one block of 8192 rows
    last = _last_frame(capsys.readouterr().err, "score")
    assert "10/10" in last and "block 1/1" in last


def test_collect_over_a_generator_shows_a_rate(capsys, monkeypatch):
    from gradtrace.common import progress

    model = tiny.MLP()
    gradtrace.collect(model, (b for b in _mlp_batches(12)), run=RunOptions(progress=True))  # no len, no total=
    last = _last_frame(capsys.readouterr().err, "collect")
    assert last.startswith("collect: 3 batch, done in ") and "batch/s" in last and last.endswith("/s")
    assert "; 12 examples, " in last
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)  # a terminal: tqdm's bar
    gradtrace.collect(model, (b for b in _mlp_batches(12)), run=RunOptions(progress=True))
    last = _last_frame(capsys.readouterr().err, "collect")
    assert "3batch" in last and "batch/s" in last and "12 examples" in last and "/s]" in last
    monkeypatch.undo()
    gradtrace.collect(model, _mlp_batches(12), run=RunOptions(progress="collect queries"))
    assert "3/3" in _last_frame(capsys.readouterr().err, "collect queries")
