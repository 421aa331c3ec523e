"""Where an artifact came from: the software that wrote it and a fingerprint of the data it was made from.

Recorded with every store, curvature and score file so that a run can be repeated and checked: the versions of
gradtrace, torch and transformers, and for data read from files their size, content hash and row count.
Stdlib only (plus torch's version string), so any layer may import it.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["environment", "file_fingerprint", "relative_path"]

_CHUNK = 1 << 22  # 4 MiB reads: hashing streams the file, whatever its size
_PACKAGES = ("gradtrace", "torch", "transformers", "datasets", "safetensors")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(packages: Iterable[str] = _PACKAGES) -> dict[str, str | None]:
    """The versions of the packages that shape an artifact (None for one that is not installed) and Python's."""
    return {**{name: _version(name) for name in packages}, "python": platform.python_version()}


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():  # a saved Hugging Face dataset or a folder of shards: every file, in a fixed order
        return sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
    raise FileNotFoundError(f"{path}: no such file or directory to fingerprint")


def file_fingerprint(path: str | os.PathLike[str], rows: int | None = None) -> dict[str, Any]:
    """Size and blake2b content hash of a data file (or of every file under a folder, names included).

    ``rows`` (the number of examples read from it, when the caller knows it) is recorded as given. Two
    fingerprints are equal exactly when the bytes (and, for a folder, the relative file names) are.
    """
    path = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    size = 0
    for file in _files(path):
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    record: dict[str, Any] = {"path": str(path), "bytes": size, "blake2b": digest.hexdigest()}
    if rows is not None:
        record["rows"] = int(rows)
    return record


def relative_path(path: str | os.PathLike[str], base: str | os.PathLike[str]) -> str:
    """``path`` written relative to the folder ``base`` when it lies under it or beside it (a sibling folder,
    ``../data.jsonl``), else absolute: a copied project then reads its own files, not the original's."""
    target = Path(path).resolve()
    folder = Path(base).resolve()
    try:
        relative = Path(os.path.relpath(target, folder))
    except ValueError:  # another drive (Windows)
        return str(target)
    ups = sum(part == ".." for part in relative.parts)
    return relative.as_posix() if ups <= 1 else str(target)
