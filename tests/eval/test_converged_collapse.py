"""bench/converged_sft.py at a small size: a model trained far past convergence ranks the planted facts no better
than chance with single final-model methods, the run's checkpoint ensemble recovers them, and the standout
diagnostic tells the two apart (issue #29, item 3)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "converged_sft.py"


@pytest.fixture(scope="module")
def result():
    spec = importlib.util.spec_from_file_location("converged_sft", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(seed=0, epochs=40, docs=60, width=64, rank=32)


# Margins, not the exact counts of this machine: 40 epochs amplify round-off differences between CPUs and BLAS
# builds, and the counts move by a query or two (here: 7/8 early, 3/8 and 0/8 at the end, 7/8 for the ensemble).
def test_the_final_model_collapses_and_the_checkpoints_recover(result):
    healthy = result["epoch 10 grad_cos"]["recall@1"]
    final = max(result["final grad_cos"]["recall@1"], result["final grad_dot"]["recall@1"])
    assert healthy >= 6, result  # early in the run the planted facts rank first
    assert final <= 4, result  # trained far past convergence: no single final-model method finds them
    assert result["ensemble all"]["recall@1"] >= max(6, final + 3), result


def test_the_standout_diagnostic_separates_collapsed_from_healthy(result):
    assert result["final grad_dot"]["warned_flat"] or result["final grad_cos"]["warned_flat"], result
    assert result["final grad_cos"]["flat"] > result["epoch 10 grad_cos"]["flat"], result
    assert not result["epoch 10 grad_cos"]["warned_flat"] and not result["epoch 10 grad_cos"]["warned_memorised"]
