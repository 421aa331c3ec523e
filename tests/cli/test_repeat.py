"""The resolved configuration's repeat command works as printed, also in a copy of the project folder, which then
reads its own data and model and writes its own store (the original is never touched)."""

from __future__ import annotations

import shlex
import shutil

import yaml

import gradtrace
from tests.cli.conftest import invoke


def _header_command(config, what: str) -> list[str]:
    """The arguments of the command the config's header prints after ``what``."""
    line = next(line for line in config.read_text().splitlines() if line.startswith(f"# {what}"))
    words = shlex.split(line.split(": ", 1)[1])
    assert words[0] == "gradtrace"
    return words[1:]


def _files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _project(ws, root, lines: int):
    root.mkdir()
    shutil.copytree(ws.model, root / "model")
    (root / "train.jsonl").write_text("".join(ws.train.read_text().splitlines(keepends=True)[:lines]))
    return root


def test_repeat_command_runs_verbatim_and_a_copied_project_reads_its_own_files(ws, runner, fresh, monkeypatch):
    original = _project(ws, fresh / "proj", lines=10)
    monkeypatch.chdir(original)
    invoke(runner, "collect", "model", "train.jsonl", "--out", "store", "--rank", 4, "--no-progress")
    config = original / "store" / "gradtrace-collect.yaml"
    saved = yaml.safe_load(config.read_text())
    assert (saved["model"], saved["data"], saved["out"]) == ("../model", "../train.jsonl", ".")
    assert saved["resume"] is False and saved["overwrite"] is False
    repeat = _header_command(config, "Repeat the run with")
    assert repeat == ["collect", "--config", "store/gradtrace-collect.yaml", "--overwrite"]
    first = gradtrace.GradientStore.open(original / "store")
    vectors = first.read(0, len(first))

    invoke(runner, *repeat)  # verbatim, in the project: recomputes the same store
    again = gradtrace.GradientStore.open(original / "store")
    assert again.ids == first.ids and bool((again.read(0, len(again)) == vectors).all())

    copy = fresh / "copy"
    shutil.copytree(original, copy)
    (copy / "train.jsonl").write_text("".join(ws.train.read_text().splitlines(keepends=True)[:12]))
    before = _files(original)
    monkeypatch.chdir(copy)
    invoke(runner, *_header_command(copy / "store" / "gradtrace-collect.yaml", "Repeat the run with"))
    assert len(gradtrace.GradientStore.open(copy / "store")) == 12  # the copy's data, into the copy's store
    assert _files(original) == before  # the original project is untouched

    (copy / "train.jsonl").write_text("".join(ws.train.read_text().splitlines(keepends=True)[:14]))
    resume = _header_command(copy / "store" / "gradtrace-collect.yaml", "Add the examples")
    assert resume == ["collect", "--config", "store/gradtrace-collect.yaml", "--resume"]
    out = invoke(runner, *resume).stdout
    assert "Stored 2 new examples (12 were already stored)" in " ".join(out.split())
    assert _files(original) == before
