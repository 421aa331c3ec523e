"""A capture that writes a gradient store, run as a script by the kill-and-resume test.

``python tests/store/capture_job.py STORE [--resume]``; with ``GRADTRACE_TEST_KILL_AFTER=N`` the process
SIGKILLs itself after ``N`` backward passes, once the background writer has committed every full shard
(what a real crash leaves). The weights are fixed (eval mode, no optimizer step) and the data is
deterministic, so every run computes the same vector for the same example id.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gradtrace.options import CaptureOptions, StoreOptions

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradtrace
from gradtrace.store import StoreWriter
from tests import tiny

NUM_EXAMPLES = 40
BATCH = 4
SHARD_ROWS = 6


def example_ids() -> list[str]:
    return [f"ex{i:03d}" for i in range(NUM_EXAMPLES)]


def run(path: str | Path, *, resume: bool = False, kill_after: int | None = None) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny.MLP().eval()
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(NUM_EXAMPLES, 7, generator=gen)
    y = torch.randint(0, 4, (NUM_EXAMPLES,), generator=gen)
    ids = example_ids()
    store = StoreWriter(path, StoreOptions(shard_rows=SHARD_ROWS, resume=resume))
    with gradtrace.capture(model, callbacks=[store],
                           options=CaptureOptions(projection=gradtrace.LoGra(rank=3, seed=5))) as cap:
        for step, start in enumerate(range(0, NUM_EXAMPLES, BATCH)):
            rows = slice(start, start + BATCH)
            cap.annotate(ids=ids[rows])
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            model.zero_grad(set_to_none=True)
            if kill_after is not None and step + 1 == kill_after:
                full = (step + 1) * BATCH // SHARD_ROWS * SHARD_ROWS  # rows in full shards (a fresh run)
                deadline = time.monotonic() + 20
                while store.writer.rows_written < full and time.monotonic() < deadline:
                    time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    kill = os.environ.get("GRADTRACE_TEST_KILL_AFTER")
    run(sys.argv[1], resume="--resume" in sys.argv[2:], kill_after=int(kill) if kill else None)
