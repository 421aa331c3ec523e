"""The demonstration of examples/noisy_training.py: 30% corrupted training data (flipped digit labels, token-shuffled
Shakespeare documents). The per-example signals of online selection and SAMA reweighting must separate corrupted
from clean examples with AUC >= 0.8 on both tasks, and training with them must end with a lower loss on clean
held-out data than plain training from the same initialisation on the same batches -- except SAMA on the language
model, whose loss is within the variation between CPUs and seeds of plain training's (docs/training.md: -0.06 to
+0.006 nats), so there it must only do no harm beyond that variation."""

from __future__ import annotations

import pytest

from examples import noisy_training


def test_auc_counts_ties_as_half():
    assert noisy_training.auc({"a": 0.0, "b": 1.0, "c": 1.0}, {"a"}) == 1.0
    assert noisy_training.auc({"a": 1.0, "b": 1.0}, {"a"}) == 0.5
    assert noisy_training.auc({"a": 2.0, "b": 1.0}, {"a"}) == 0.0


@pytest.mark.parametrize("task", ["digits", "lm"])
def test_selection_and_sama_beat_plain_training_and_find_the_corrupted_examples(task):
    pytest.importorskip("sklearn" if task == "digits" else "transformers")
    rows = {r["method"]: r for r in noisy_training.main([task], verbose=False)[task]}
    plain = rows["plain"]["test_loss"]
    for method in ("selection", "sama"):
        assert rows[method]["auc"] >= 0.8, (method, rows[method]["auc"])
        if task == "lm" and method == "sama":
            # a margin of 0.02 nats is 3x the largest loss increase measured over CPUs, thread counts and seeds
            assert rows[method]["test_loss"] <= plain + 0.02, (method, rows[method]["test_loss"], plain)
        else:
            assert rows[method]["test_loss"] < plain, (method, rows[method]["test_loss"], plain)
