"""``bench/gpu_check.py`` on the CPU: the ``--quick`` run in a subprocess reports every check with a status and
passes the checks that run on a CPU; the CUDA-only checks are skipped with their reason; a check that raises is an
``error`` row, the others still run, and the exit status says so.

Checks 8-10 (MoE experts, gpt-oss attention sinks, metagradients) run at their ``--quick`` sizes: every row passes
except 8c, the MoE collection time, whose 1.0x bound is the device's target: on the CPU it is reported and skipped.

The subprocess run adds ``--self-compare`` (the device-vs-CPU comparisons 4b and 5, CPU against CPU) and
``--ddp-backend gloo`` (check 7's two-rank launch on CPU processes), so that every code path the GPU run takes,
except the CUDA calls themselves, has run here once.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
ROWS = ["1a", "1b", "1c", "2a", "2b", "2c", "2d", "3", "4a", "4b", "5", "6", "7", "8a", "8b", "8c", "9a", "9b", "10a",
        "10b", "10c"]
CUDA_ONLY = {"2a", "2b", "3"}  # skipped on the CPU whatever the flags
DEVICE_TARGET = {"8c"}  # measured on the CPU too, but its bound is the device's target: skipped, with the number


def _module():
    """The script as a module (registered under its name: its dataclasses look their module up)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def _rows(markdown: str) -> dict[str, dict[str, str]]:
    """The table between the markers: ``{check: {column: cell}}``."""
    block = re.search(r"^<!-- gpu_check:begin -->$(.*?)^<!-- gpu_check:end -->$", markdown, re.M | re.S).group(1)
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    out = {}
    for line in lines[1:]:
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(head), line
        out[cells[0]] = dict(zip(head, cells))
    return out


def test_cpu_quick_run_reports_every_check(tmp_path):
    page = tmp_path / "gpu.md"
    intro = "# page\n\nthe block goes between `<!-- gpu_check:begin -->` and `<!-- gpu_check:end -->`.\n\n"
    page.write_text(intro + "<!-- gpu_check:begin -->\nold block\n<!-- gpu_check:end -->\n\ntail\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: threads only oversubscribe them
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--self-compare",
                           "--ddp-backend", "gloo", "--out", str(page)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    text = page.read_text()
    assert text.startswith(intro + "<!-- gpu_check:begin -->\n- command: ") and text.endswith("\ntail\n")
    assert "old block" not in text
    assert "not a GPU run" in text
    rows = _rows(text)
    assert list(rows) == ROWS, proc.stdout
    for check, row in rows.items():
        expected = "skip" if check in CUDA_ONLY | DEVICE_TARGET else "pass"
        assert row["status"] == expected, (check, row)
        assert row["notes"], (check, row)  # the setup, or the reason for a skip
    assert all("needs CUDA" in rows[c]["notes"] for c in CUDA_ONLY)
    assert "gloo" in rows["7"]["notes"]
    # the new device paths: MoE experts, attention sinks, metagradients (values and what the notes must say)
    assert all("experts products: " in rows[c]["notes"] for c in ("8a", "8c")), (rows["8a"], rows["8c"])
    assert "rows route every token alike" in rows["8b"]["notes"]
    assert re.fullmatch(r"\d+\.\d\dx \(.* s\)", rows["8c"]["value"]) and "1.0x on CUDA" in rows["8c"]["bound"]
    assert rows["9b"]["value"] == "capture 100.0%, store 100.0%" and "attention-sinks" in rows["9b"]["notes"]
    assert rows["10a"]["value"] == "0 (bit-exact)", rows["10a"]  # the CPU's single-tensor kernels replay bit for bit
    assert float(rows["10b"]["value"]) <= 1e-4 and "float64" in rows["10b"]["notes"]
    assert rows["10c"]["bound"] == "none (informative)"


def test_skips_name_their_reason_on_the_cpu(tmp_path):
    gpu_check = _module()
    ctx = gpu_check.Context(device=torch.device("cpu"), quick=True, tmp=tmp_path, ddp_backend="auto")
    rows = [*itertools.islice(gpu_check.check_host_syncs(ctx), 2), *gpu_check.check_memory(ctx),
            *gpu_check.check_scores(ctx), *gpu_check.check_ddp(ctx)]
    assert [r.check for r in rows] == ["2a", "2b", "3", "5", "7"]
    assert all(r.status == "skip" and r.notes for r in rows), rows
    assert "2 CUDA devices" in rows[-1].notes
    int8 = list(gpu_check.check_int8(ctx))
    assert [(r.check, r.status) for r in int8] == [("4a", "pass"), ("4b", "skip")], int8


def test_a_raising_check_is_an_error_row_and_the_others_run(tmp_path, monkeypatch, capsys):
    gpu_check = _module()

    def raises(ctx):
        yield gpu_check.Row("98a", "first", "1", "-", "pass", "done before the error")
        raise RuntimeError("out of memory")

    def fails(ctx):
        yield gpu_check.Row("99", "fails", "2", "<= 1", "fail", "too big")

    ctx = gpu_check.Context(device=torch.device("cpu"), quick=True, tmp=tmp_path, ddp_backend="auto")
    rows = gpu_check.run_checks(ctx, {"98": raises, "3": gpu_check.check_memory})
    assert [(r.check, r.status) for r in rows] == [("98a", "pass"), ("98", "error"), ("3", "skip")]
    assert "RuntimeError: out of memory" in rows[1].notes
    monkeypatch.setitem(gpu_check.CHECKS, "99", fails)  # not one of the real checks
    assert gpu_check.main(["--device", "cpu", "--only", "3"]) == 0
    assert gpu_check.main(["--device", "cpu", "--only", "3,99", "--out", str(tmp_path / "new.md")]) == 1
    assert "failing: 99" in capsys.readouterr().out
    assert _rows((tmp_path / "new.md").read_text()).keys() == {"3", "99"}
