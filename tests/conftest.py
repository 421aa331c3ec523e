import os

import pytest
import torch

# Two CI cores: keep each test process single-threaded so xdist workers do not fight.
torch.set_num_threads(int(os.environ.get("GRADTRACE_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
