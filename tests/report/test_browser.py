"""The report in a real browser: headless Chromium renders it to a screenshot and a DOM (run when Chromium is
installed; ``make report-check`` installs it and requires this test to run)."""

from __future__ import annotations

import html as htmllib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtrace.options.report import ReportOptions
from gradtrace.report import render_report
from tests.report.helpers import read_png, synthetic

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("GRADTRACE_REQUIRE_CHROMIUM") == "1"
WIDTH, HEIGHT = 1366, 900  # a laptop screen
POSITIVE, NEGATIVE = (0x15, 0x80, 0x3D), (0xB9, 0x1C, 0x1C)  # --pos, --neg of report.css
NUM_QUERIES, NUM_TRAIN, PER_PAGE = 6, 200, 3  # two query pages: q0-q2, q3-q5

pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRED,
                                reason="chromium is not installed (make report-check installs it)")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("GRADTRACE_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install -y chromium)")
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def _report(tmp_path: Path) -> tuple[Path, object, dict[str, str]]:
    scores, texts, queries = synthetic(num_queries=NUM_QUERIES, num_train=NUM_TRAIN)
    scores.matrix[:, 3] = 5.0  # the training text with a script tops every query
    top = scores.topk(1)
    value = float(top.values[0, 0])
    scores.meta["tokens"] = [{"query_id": "query-0", "train_id": top.ids[0][0], "train_tokens": ["a", "b"],
                              "train_scores": [0.75 * value, 0.25 * value], "train_in_loss": [False, True]}]
    out = tmp_path / "report.html"
    render_report(scores, texts, queries, out, ReportOptions(per_page=PER_PAGE), self_scores=torch.rand(NUM_TRAIN))
    return out, scores, texts


def _screenshot(tmp_path: Path, url: str) -> np.ndarray:
    png = tmp_path / "shot.png"
    # (no --virtual-time-budget: with it Chromium 156 paints only the top 757 of 900 rows)
    _chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}", url)
    image = read_png(png.read_bytes())[..., :3]
    assert image.shape == (HEIGHT, WIDTH, 3)
    return image


def _assert_drawn(image: np.ndarray) -> None:
    """Text, bars and a histogram on screen: not a blank or single-colour page."""
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50
    assert np.all(image == image[-1, -1], axis=-1).mean() < 0.9
    for color in (POSITIVE, NEGATIVE):  # helpful and harmful score bars drawn in their colours
        assert np.all(image == color, axis=-1).sum() > 500, color


PROBE = """<script>setTimeout(function () {
  var shown = function (sel) { return Array.prototype.filter.call(document.querySelectorAll(sel),
    function (e) { return e.getClientRects().length > 0; }).map(function (e) { return e.id; }); };
  var target = document.getElementById(location.hash.slice(1));
  document.body.setAttribute("data-probe", JSON.stringify({scroll: window.scrollY, height: window.innerHeight,
    queries: shown(".query"), examples: shown(".te"), views: shown(".view"),
    top: target ? target.getBoundingClientRect().top : null}));
}, 300);</script>"""


def _probe(tmp_path: Path, report: Path, fragment: str) -> dict:
    """What is on screen after opening ``report#fragment``: a copy of the report with a probe script (its
    Content-Security-Policy, which runs the report's own script only, left out)."""
    copy = tmp_path / "probed.html"
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", report.read_text(encoding="utf-8"))
    copy.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = _chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=2000", "--dump-dom",
                    f"{copy.as_uri()}#{fragment}").stdout
    return json.loads(htmllib.unescape(re.search(r'data-probe="([^"]*)"', dom).group(1)))


def test_screenshot_shows_the_first_query_with_bars_and_histogram(tmp_path):
    report, _, _ = _report(tmp_path)
    _assert_drawn(_screenshot(tmp_path, f"{report.as_uri()}#page-1"))


@pytest.mark.parametrize("query", [0, 2, 4])  # first and last of page 1, one of page 2
def test_a_query_link_opens_that_query_alone_at_the_top(tmp_path, query):
    report, _, _ = _report(tmp_path)
    # the page used to scroll to the query, and headless Chromium's screenshot of a scrolled page is blank
    _assert_drawn(_screenshot(tmp_path, f"{report.as_uri()}#q{query}"))
    seen = _probe(tmp_path, report, f"q{query}")
    assert seen["queries"] == [f"q{query}"] and seen["views"] == [f"page-{query // PER_PAGE + 1}"]
    assert seen["scroll"] == 0 and 0 < seen["top"] < seen["height"] / 2  # under the header, in view


def test_a_training_id_link_opens_its_ranks(tmp_path):
    report, scores, _ = _report(tmp_path)
    row = int(scores.topk(1).indices[1, 0])
    seen = _probe(tmp_path, report, f"x{row}")
    assert seen["examples"] == [f"x{row}"] and seen["views"] == ["train"]
    assert seen["scroll"] == 0 and 0 < seen["top"] < seen["height"]  # under the header and the section's note


def test_search_box_finds_an_id_and_shows_its_rank_for_each_query(tmp_path):
    report, scores, texts = _report(tmp_path)
    term = "t4"  # t4, t40..t49, and every text holding "t4"
    dom = _chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=2000", "--dump-dom",
                    f"{report.as_uri()}#find={term}").stdout
    assert re.search(r'<input id="find"(?![^>]*hidden)[^>]*>', dom)  # the script ran: the box is shown
    rows = re.findall(r'<tr class="te( exact)?" id="x(\d+)"( hidden="")?>(.*?)</tr>', dom, re.S)
    listed = [scores.train_ids[int(j)] for _, j, _, _ in rows]
    visible = [scores.train_ids[int(j)] for _, j, hidden, _ in rows if not hidden]
    assert visible == [t for t in listed if term in t or term in texts[t].lower()] and len(visible) < len(listed)
    assert f"{len(visible)} of {len(listed)} training examples match" in dom
    exact = [(scores.train_ids[int(j)], cells) for mark, j, _, cells in rows if mark]
    ranking = scores.topk(NUM_TRAIN)
    for tid, cells in exact:  # the id searched for, highlighted, with its rank for every query as Scores ranks it
        ranks = [int(r.replace(",", "")) for r in re.findall(r"<td(?: class=\"\w+\")?>([\d,]+)</td>", cells)]
        assert ranks == [ranking.ids[q].index(tid) + 1 for q in range(NUM_QUERIES)]
    assert [tid for tid, _ in exact] == ([term] if term in listed else [])


def test_script_in_a_training_text_does_not_run(tmp_path):
    report, _, _ = _report(tmp_path)
    dom = _chromium(tmp_path, "--virtual-time-budget=2000", "--dump-dom", report.as_uri()).stdout
    assert "<body>" in dom and "data-pwned" in dom  # the text is there ...
    assert "<body data-pwned" not in dom  # ... and its script did not run
