"""Every ``gradtrace <command> --flag`` the README and docs/ show -- in a shell line (``$ gradtrace ...``) or inline
(`` `gradtrace fit STORE --method trak` ``) -- is a flag of that command: a renamed option fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from gradtrace.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"(?:^\$ |^|`)gradtrace ([a-z][a-z-]*)((?: [^`\n]*)?)", re.M)
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def _flags() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {name: {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            for name, command in group.commands.items()}


FLAGS = _flags()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_shown_belongs_to_its_command(page):
    wrong = []
    for command, rest in COMMAND.findall(page.read_text()):
        if command not in FLAGS:  # prose ("gradtrace refuses ..."), not a command line
            continue
        wrong += [f"gradtrace {command} {flag}" for flag in FLAG.findall(rest) if flag not in FLAGS[command]]
    assert not wrong, f"{page.name} shows flags the commands do not have: {sorted(set(wrong))}"


def test_the_check_sees_the_commands():
    assert {"collect", "fit", "score", "topk", "report", "index", "inspect", "self-influence"} <= FLAGS.keys()
    assert "--member-fit" in FLAGS["score"] and "--optimizer" in FLAGS["fit"]
