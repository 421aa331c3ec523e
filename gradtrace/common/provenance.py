"""Where an artifact came from: the software that wrote it and a fingerprint of the data it was made from.

Recorded with every store, curvature and score file so that a run can be repeated and checked: the versions of
gradtrace, torch and transformers, and for data read from files their size, content hash and row count.
Stdlib only (plus torch's version string), so any layer may import it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["ORIGIN_KEY", "PATH_KEYS", "environment", "file_fingerprint", "record_paths", "relative_path",
           "resolve_path", "resolve_paths"]

_CHUNK = 1 << 22  # 4 MiB reads: hashing streams the file, whatever its size
_PACKAGES = ("gradtrace", "torch", "transformers", "datasets", "safetensors")
PATH_KEYS = frozenset({"model", "base_model", "data", "store", "queries", "out", "export", "curvature", "index",
                       "checkpoint_stores", "path"})
"""Keys of a recorded configuration (the resolved options of a command) whose string values are paths: written
relative to the artifact's folder by :func:`record_paths`, read back against it by :func:`resolve_paths`."""
ORIGIN_KEY = "recorded_in"
"""Key of the folder an artifact's paths were recorded relative to (where it was written)."""
_NESTED = ("gradtrace", "checkpoint")  # blocks searched for path keys too: the provenance block's data fingerprint, the
# checkpoint a store was collected at (gradtrace.collect_checkpoints)


@functools.cache
def _version(package: str) -> str | None:
    """The installed version (read once per process: the code this process runs is the one imported then)."""
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


def resolve_path(value: str | os.PathLike[str], base: str | os.PathLike[str],
                 origin: str | os.PathLike[str] | None = None) -> Path:
    """A recorded path read back: a relative one is relative to the folder ``base`` of the artifact that recorded
    it (:func:`relative_path`), an absolute one (older records) is taken as it is. ``origin``: the folder where the
    artifact was written; a relative path missing beside ``base`` but present beside ``origin`` (the artifact was
    copied alone, without the files it points at) is taken from there."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    here = Path(os.path.normpath(Path(base).absolute() / path))
    if origin is not None and not here.exists():
        there = Path(os.path.normpath(Path(origin) / path))
        return there if there.exists() else here
    return here


def _map_paths(record: dict[str, Any], convert: Any) -> dict[str, Any]:
    """``record`` with ``convert`` applied to the string values (and lists of strings) of :data:`PATH_KEYS`, here
    and in the nested blocks (``gradtrace`` provenance, a ``data`` fingerprint); other values as given."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict) and (key in PATH_KEYS or key in _NESTED):
            out[key] = _map_paths(value, convert)
        elif key in PATH_KEYS and isinstance(value, str) and value:
            out[key] = convert(value)
        elif key in PATH_KEYS and isinstance(value, list) and all(isinstance(v, str) and v for v in value):
            out[key] = [convert(v) for v in value]
        else:
            out[key] = value
    return out


def record_paths(record: dict[str, Any], base: str | os.PathLike[str]) -> dict[str, Any]:
    """A copy of ``record`` (a command's resolved options) with its absolute paths written relative to the folder
    ``base`` of the artifact that keeps it, where they lie under or beside it (:func:`relative_path`): a copied
    project then points at its own model and data. ``record[ORIGIN_KEY]`` keeps the folder it was written in, so
    an artifact copied alone still finds the original files. :func:`resolve_paths` reads them back."""
    out = _map_paths(record, lambda value: relative_path(value, base) if os.path.isabs(value) else value)
    out[ORIGIN_KEY] = str(Path(base).resolve())
    return out


def resolve_paths(record: dict[str, Any], base: str | os.PathLike[str]) -> dict[str, Any]:
    """A copy of ``record`` with the paths :func:`record_paths` wrote relative to ``base`` made absolute again:
    against ``base`` (the artifact's folder now), else against the folder it was written in when only that holds
    the file; absolute ones, as older artifacts recorded them, are kept."""
    origin = record.get(ORIGIN_KEY)
    return _map_paths(record, lambda value: str(resolve_path(value, base, origin)))
