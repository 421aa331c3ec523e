"""``gradtrace.collect`` into a store, run as a script by the kill-and-resume tests.

``python tests/store/collect_job.py STORE [--resume]``; with ``GRADTRACE_TEST_SIGNAL=NAME`` and
``GRADTRACE_TEST_KILL_AFTER=N`` the process sends itself that signal (``SIGTERM``, ``SIGKILL``) when the data
has yielded ``N`` batches, once the rows of the batches before are captured. Shards have the default size
(256 MiB), far more than the 40 rows: every kill lands in the first shard. Weights and data are fixed, so
every run computes the same vector for the same id.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from gradtrace.options import CaptureOptions, RunOptions, StoreOptions

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradtrace
from tests import tiny

NUM_EXAMPLES = 40
BATCH = 4


def example_ids() -> list[str]:
    return [f"ex{i:03d}" for i in range(NUM_EXAMPLES)]


def run(path: str | Path, *, resume: bool = False, kill: tuple[signal.Signals, int] | None = None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny.MLP()
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(NUM_EXAMPLES, 7, generator=gen)
    y = torch.randint(0, 4, (NUM_EXAMPLES,), generator=gen)

    def batches():
        for step, start in enumerate(range(0, NUM_EXAMPLES, BATCH)):
            if kill is not None and step == kill[1]:
                os.kill(os.getpid(), kill[0])
            yield x[start:start + BATCH], y[start:start + BATCH]

    return gradtrace.collect(model, batches(), store=path,
                             options=CaptureOptions(projection=gradtrace.LoGra(rank=3, seed=5)),
                             store_options=StoreOptions(dtype="int8", resume=resume), run=RunOptions(ids=example_ids()))


if __name__ == "__main__":
    name, after = os.environ.get("GRADTRACE_TEST_SIGNAL"), os.environ.get("GRADTRACE_TEST_KILL_AFTER")
    run(sys.argv[1], resume="--resume" in sys.argv[2:],
        kill=(signal.Signals[name], int(after)) if name and after else None)
