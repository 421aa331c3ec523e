import os

import pytest
import torch

# Two CI cores: keep each test process single-threaded so xdist workers do not fight.
torch.set_num_threads(int(os.environ.get("GRADTRACE_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_terminal_size(monkeypatch):
    """The commands' output in the tests is not a terminal's: pytest-xdist's workers set ``COLUMNS=80`` (which the
    commands honour, as rich does), a plain run does not; without it both see the same unwrapped lines."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
