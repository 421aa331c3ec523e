"""Every ``gradtrace.<name>`` the README and docs/ mention, and every ``from gradtrace... import ...`` in their code,
exists: a renamed or never-exported function fails here rather than in a user's first paste."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"(?<![\w/.-])gradtrace(?:\.[A-Za-z_]\w*)+")  # not a path (gradtrace/...), not the command
IMPORT = re.compile(r"^\s*from (gradtrace[\w.]*) import \(?([\w, ]+)\)?", re.M)
FILES = (".yaml", ".yml", ".toml", ".json", ".md", ".py")  # gradtrace.yaml: a config file's name


def _resolve(name: str) -> object:
    """The object ``name`` (``package.module.attr.attr``) names: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for attr in parts[cut:]:
        obj = getattr(obj, attr)
    return obj


def _names(page: Path) -> set[str]:
    text = page.read_text()
    names = {m.group(0) for m in DOTTED.finditer(text) if not m.group(0).endswith(FILES)}
    names |= {f"{m.group(1)}.{n.strip()}" for m in IMPORT.finditer(text) for n in m.group(2).split(",") if n.strip()}
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_the_page_mentions_exists(page):
    missing = []
    for name in sorted(_names(page)):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as err:
            missing.append(f"{name} ({type(err).__name__}: {err})")
    assert not missing, f"{page.name} mentions names gradtrace does not have: {missing}"
