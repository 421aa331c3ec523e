"""The app itself: --help everywhere, --version, python -m gradtrace.cli, the demo command."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import typer.main

import gradtrace
from gradtrace.cli import app
from gradtrace.cli.commands import COMMANDS, flat_fields
from tests.cli.conftest import error_line, flat, invoke

REPO = Path(__file__).resolve().parents[2]


def test_version(runner):
    assert invoke(runner, "--version").stdout.strip() == f"gradtrace {gradtrace.__version__}"


@pytest.mark.parametrize("command", ["collect", "score", "topk", "inspect", "demo"])
def test_every_option_has_help(runner, command):
    click_command = typer.main.get_command(app).commands[command]
    for param in click_command.params:
        assert (getattr(param, "help", None) or "").strip(), f"{command}: {param.name} has no help"
    text = flat(invoke(runner, command, "--help").stdout)
    for spec in flat_fields(COMMANDS[command]):
        flags = spec.info["decls"] or (f"--{spec.name.replace('_', '-')}",)
        if spec.info["kind"] == "option":
            assert flags[0].split("/")[0] in text, f"{command} --help lacks {flags[0]}"
    assert "--config" in text


def test_top_level_help_lists_commands(runner):
    text = flat(invoke(runner, "--help").stdout)
    for command in ("collect", "score", "topk", "inspect", "demo"):
        assert command in text
    assert "positive = the training example helps the query" in text


def test_python_m_gradtrace_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "gradtrace.cli", "--help"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "collect" in result.stdout and "score" in result.stdout
    result = subprocess.run([sys.executable, "-m", "gradtrace.cli", "inspect", str(tmp_path)], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1


def test_demo_calls_gradtrace_demo_main(runner, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("gradtrace.demo")
    fake.main = lambda out_dir: calls.append(out_dir)
    monkeypatch.setitem(sys.modules, "gradtrace.demo", fake)
    invoke(runner, "demo", "--out", tmp_path / "d")
    assert calls == [tmp_path / "d"]


def test_demo_missing(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "gradtrace.demo", None)
    line = error_line(invoke(runner, "demo", code=1))
    assert "demo is not available" in line
