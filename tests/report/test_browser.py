"""The report in a real browser: headless Chromium renders it to a screenshot (run when Chromium is installed;
``make report-check`` installs it and requires this test to run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtrace.report import render_report
from tests.report.helpers import read_png, synthetic

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("GRADTRACE_REQUIRE_CHROMIUM") == "1"
WIDTH, HEIGHT = 1366, 900  # a laptop screen
POSITIVE, NEGATIVE = (0x15, 0x80, 0x3D), (0xB9, 0x1C, 0x1C)  # --pos, --neg of report.css

pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRED,
                                reason="chromium is not installed (make report-check installs it)")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("GRADTRACE_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install -y chromium)")
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def _report(tmp_path: Path) -> Path:
    scores, texts, queries = synthetic(num_queries=3, num_train=200)
    scores.matrix[:, 3] = 5.0  # the training text with a script tops every query
    top = scores.topk(1)
    value = float(top.values[0, 0])
    scores.meta["tokens"] = [{"query_id": "query-0", "train_id": top.ids[0][0], "train_tokens": ["a", "b"],
                              "train_scores": [0.75 * value, 0.25 * value]}]
    out = tmp_path / "report.html"
    render_report(scores, texts, queries, out=out, self_scores=torch.rand(200))
    return out


def test_screenshot_shows_the_first_query_with_bars_and_histogram(tmp_path):
    report = _report(tmp_path)
    png = tmp_path / "shot.png"
    _chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}", f"{report.as_uri()}#page-1")
    image = read_png(png.read_bytes())[..., :3]
    assert image.shape == (HEIGHT, WIDTH, 3)
    colors = np.unique(image.reshape(-1, 3), axis=0)
    assert len(colors) > 50  # text, bars, histogram: not a blank or single-colour page
    background = np.all(image == image[-1, -1], axis=-1).mean()
    assert background < 0.9
    for color in (POSITIVE, NEGATIVE):  # helpful and harmful score bars drawn in their colours
        assert np.all(image == color, axis=-1).sum() > 500, color


def test_script_in_a_training_text_does_not_run(tmp_path):
    report = _report(tmp_path)
    dom = _chromium(tmp_path, "--dump-dom", report.as_uri()).stdout
    assert "<body>" in dom and "data-pwned" in dom  # the text is there ...
    assert "<body data-pwned" not in dom  # ... and its script did not run
