"""The one format helper of gradtrace's artifacts: checksums, atomic writes, and the manifest + tensors layout.

Gradient stores (:mod:`gradtrace.store.layout`: manifest, shard records, rank files, locks), fitted curvature
and saved scores all write through :func:`atomic_write_bytes` / :func:`create_exclusive` (tensor files through
:func:`write_tensors` and a rename) and checksum with
:func:`checksum` (blake2b-128). Curvature and scores are directory artifacts: a JSON manifest beside one
safetensors file, written atomically and verified on load (:func:`write_artifact`, :func:`read_artifact`).

::

    DIR/
      NAME.json                         manifest: format, version, the artifact's own fields, and
                                        "tensors": {file, bytes, blake2b, index: {tensor: {dtype, shape}}},
                                        "manifest_blake2b": checksum of everything above (canonical JSON)
      NAME-<16 hex>.safetensors         the tensors (safe format: no pickles), named by their checksum

A save writes the tensor file under its new name (temporary file, fsync, rename), then replaces the
manifest the same way, then removes the tensor file of the previous save. A save that fails at any point
(a full disk) leaves the previous artifact as it was, readable. A load checks, in order: the manifest
parses and is of the expected format and version; its own checksum (so an edited id list, shape or
block list is refused); the tensor file's name stays inside DIR, its size (truncation) and checksum
(a flipped bit, a replaced file); and that it holds exactly the tensors the manifest lists, with their
dtypes and shapes. Each failure is one line naming the file and what to do.

Version-1 artifacts (gradtrace before checksums: ``NAME.json`` + ``NAME.safetensors``) still load, with an
:class:`UncheckedArtifactWarning`; the structural checks each artifact makes on its tensors still apply.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.provenance import environment
from .atomic import (
    atomic_output,
    atomic_write_bytes,
    atomic_write_json,
    create_exclusive,
    fsync_dir,
    naming,
    temporary_name,
)
from .locking import directory_lock, lock_is_stale

__all__ = ["ArtifactError", "ArtifactExists", "UncheckedArtifactWarning", "artifact_file", "atomic_output",
           "atomic_write_bytes", "atomic_write_json", "canonical_json", "checksum", "create_exclusive", "file_checksum",
           "fsync_dir", "json_bytes", "read_artifact", "temporary_name", "write_artifact"]

LEGACY_VERSION = 1
"""The version that carried no checksums (read with a warning)."""


class ArtifactError(ValueError):
    """A saved artifact is missing a file, truncated, corrupted, edited or of another format."""


class UncheckedArtifactWarning(UserWarning):
    """An artifact saved before gradtrace recorded checksums was loaded: its contents could not be verified."""


# -- atomic writes and checksums (stores, curvature, scores) ----------------------------------------------
def checksum(*chunks: bytes) -> str:
    """The blake2b-128 hex digest every gradtrace artifact records (store records, manifests, tensor files)."""
    h = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def json_bytes(data: Any) -> bytes:
    """The bytes a store writes for a JSON document (records, status files, manifest)."""
    return json.dumps(data, indent=1, sort_keys=False).encode()


def file_checksum(path: Path, block: int = 16 * 2**20) -> str:
    """:func:`checksum` of a file's bytes, read in blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(data: Any) -> bytes:
    """The bytes a checksum of JSON data is taken over: sorted keys, no whitespace, ASCII."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _own_memory(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` contiguous on the CPU, each in memory of its own (safetensors refuses two names for one storage):
    a tensor sharing its storage with an earlier one is copied; the others are used as they are."""
    out, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous().cpu()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return out


def write_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` (contiguous, on the CPU) to the safetensors file ``path`` from their own memory, fsynced."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path))
    except SafetensorError as err:  # a full disk or an I/O error, reported as the OSError it is
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err
    with open(path, "rb") as f:
        os.fsync(f.fileno())


FileWriter = Callable[[Path], None]
"""Writes one file of an artifact to the (temporary) path it is given."""


class ArtifactExists(ArtifactError):
    """A save without ``overwrite`` found an artifact already saved where it was to write."""


def _publish(directory: Path, name: str, suffix: str, writer: FileWriter, created: list[Path]) -> dict[str, Any]:
    """Write one file through ``writer`` to a temporary name of its own, fsync it, hash it and rename it to its
    content-addressed name ``name-<16 hex>suffix``; returns ``{file, bytes, blake2b}``. A file of that name and
    checksum already there (a re-save of equal contents) is kept; a file this call creates is added to
    ``created`` (the caller removes them when the save fails before it is published)."""
    tmp = temporary_name(directory / f"{name}{suffix}")
    try:
        writer(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = file_checksum(tmp)
        final = directory / f"{name}-{digest[:16]}{suffix}"
        # a re-save of equal contents reuses the file the old manifest names -- unless that file was damaged since
        if not (final.is_file() and file_checksum(final) == digest):
            os.replace(tmp, final)
            created.append(final)
            fsync_dir(directory)
    except OSError as err:
        raise naming(err, directory, tmp) from err
    finally:
        tmp.unlink(missing_ok=True)
    return {"file": final.name, "bytes": final.stat().st_size, "blake2b": digest}


def write_artifact(directory: str | Path, stem: str, fmt: str, version: int, fields: dict[str, Any],
                   tensors: dict[str, Tensor], *, files: dict[str, tuple[str, FileWriter]] | None = None,
                   overwrite: bool = True, what: str | None = None, legacy_files: tuple[str, ...] = ()) -> Path:
    """Save ``tensors``, the files ``files`` writes and the JSON-able ``fields`` as the artifact
    ``directory/stem.json``; returns its path.

    The whole save holds the directory's write lock (:func:`gradtrace.store.locking.directory_lock`: a second
    writer is refused, naming the first). Every file is written under a temporary name of its own, fsynced,
    hashed and renamed to its content-addressed name (``stem-<hash>.safetensors`` for the tensors,
    ``stem-<role>-<hash><suffix>`` for each ``files[role] = (suffix, writer)``); then the manifest, which lists
    each with its size and checksum, is replaced in one rename: the step that publishes the new artifact. Only
    then are the files of the previous save (and ``legacy_files``, names an older layout used) removed. A save
    that fails at any point -- a full disk, a kill -- leaves the previous artifact whole and loadable, and no
    file of its own behind but temporaries the next save removes.

    The tensors are written straight from their memory (``safetensors.torch.save_file``: no serialized copy).
    ``overwrite=False`` refuses (:class:`ArtifactExists`) when ``stem.json`` is already there, checked under
    the lock. ``what`` names the artifact in messages (default ``stem``). I/O errors propagate as
    :class:`OSError`.
    """
    directory = Path(directory)
    what = what or stem
    files = dict(files or {})
    manifest_path = directory / f"{stem}.json"
    try:
        with directory_lock(directory, what):
            if not overwrite and manifest_path.exists():
                raise ArtifactExists(f"{directory} already holds saved {what}: pass overwrite=True (--overwrite) to "
                                     "replace them")
            tensors = _own_memory(tensors)
            created: list[Path] = []
            try:
                entry = _publish(directory, stem, ".safetensors", lambda tmp: write_tensors(tmp, tensors), created)
                extra = {role: _publish(directory, f"{stem}-{role}", suffix, writer, created)
                         for role, (suffix, writer) in sorted(files.items())}
                index = {name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
                         for name, t in sorted(tensors.items())}
                record = {"format": fmt, "version": version, "environment": environment(), **fields}
                manifest = json.loads(json.dumps(record))  # keys as they read back
                manifest["tensors"] = {**entry, "index": index}
                if extra:
                    manifest["files"] = extra
                manifest["manifest_blake2b"] = checksum(canonical_json(manifest))
                atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
            except BaseException:
                for path in created:
                    path.unlink(missing_ok=True)
                raise
            keep = {entry["file"], *(e["file"] for e in extra.values())}
            _remove_stale(directory, stem, keep, (f"{stem}.safetensors", *legacy_files))
    except OSError as err:  # the lock file, a directory's fsync: named as the artifact the user asked for
        raise naming(err, directory) from err
    return manifest_path


def _remove_stale(directory: Path, stem: str, keep: set[str], legacy: tuple[str, ...]) -> None:
    """Remove what earlier saves left (under the directory's lock, so no other writer's files): their
    content-addressed files, the files of an older layout and temporaries of interrupted saves. Best effort: a
    leftover file is harmless, never read."""
    pattern = re.compile(rf"{re.escape(stem)}(-[a-z_]+)?-[0-9a-f]{{16}}\.[a-z]+")
    for path in directory.iterdir():
        name = path.name
        if name in keep:
            continue
        dead_lock_temp = name.startswith(".tmp-.gradtrace-write.lock.") and _dead_writer(name)
        if pattern.fullmatch(name) or name in legacy or name.startswith((f".tmp-{stem}.", f".tmp-{stem}-")) \
                or dead_lock_temp:
            with contextlib.suppress(OSError):
                path.unlink()


def _dead_writer(temporary: str) -> bool:
    """Whether the process that made :func:`temporary_name` file ``temporary`` (pid after the file's name) is gone."""
    parts = temporary.rsplit(".", 3)
    return len(parts) == 4 and parts[1].isdigit() and lock_is_stale({"pid": int(parts[1]),
                                                                     "host": socket.gethostname()})


def artifact_file(directory: str | Path, manifest: dict[str, Any], role: str) -> Path:
    """The path of file ``role`` of an artifact read by :func:`read_artifact` (checked there)."""
    return Path(directory) / manifest["files"][role]["file"]


def read_artifact(directory: str | Path, stem: str, fmt: str, version: int, *, what: str, noun: str | None = None,
                  error: type[Exception] = ArtifactError) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The manifest and tensors of the artifact ``directory/stem.json``, verified (see the module docstring);
    every other file the manifest lists (``files``: :func:`artifact_file`) is checked too (size, checksum).

    what: how messages name the artifact (``"scores"``), noun: as an adjective (``"score"``, default ``what``);
    error: the exception type raised for a corrupted artifact. A missing manifest raises
    :class:`FileNotFoundError`. A save that publishes a new artifact while this read runs (the manifest changed
    under it) makes the read start again with the new manifest rather than fail.
    """
    directory = Path(directory)
    manifest_path = directory / f"{stem}.json"
    for attempt in range(3):
        if not manifest_path.exists():
            raise FileNotFoundError(f"{directory} holds no saved {what} ({manifest_path.name} missing)")
        try:
            raw = manifest_path.read_bytes()
        except OSError as err:
            raise error(f"{manifest_path} is not readable ({err.strerror or err}); the {what} must be saved "
                        "again") from None
        try:
            return _read_verified(directory, stem, raw, fmt, version, what, noun, error)
        except error:
            try:
                replaced = manifest_path.read_bytes() != raw
            except OSError:
                replaced = False
            if not replaced or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _read_verified(directory: Path, stem: str, raw: bytes, fmt: str, version: int, what: str, noun: str | None,
                   error: type[Exception]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    manifest_path = directory / f"{stem}.json"
    try:
        manifest = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise error(f"{manifest_path} is not readable JSON ({err}); the {what} must be saved again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise error(f"{directory} is not a gradtrace {noun or what} file ({manifest_path.name} has no format {fmt!r})")
    found = manifest.get("version")
    if found == LEGACY_VERSION:
        warnings.warn(f"{directory}: {what} saved by an older gradtrace (version {LEGACY_VERSION}) carry no "
                      "checksums, so corruption cannot be detected; save them again to add checksums",
                      UncheckedArtifactWarning, stacklevel=4)
        return manifest, _load_tensors(directory / f"{stem}.safetensors", what, error)
    if found != version:
        raise error(f"{manifest_path}: {what} of version {found!r}; this gradtrace reads versions "
                    f"{LEGACY_VERSION} and {version} (use the gradtrace that saved them)")
    _check_manifest(manifest_path, manifest, what, error)
    for entry in (manifest.get("files") or {}).values():
        _check_tensor_file(directory / entry["file"], entry, what, error)
    entry = manifest["tensors"]
    tensor_path = directory / entry["file"]
    _check_tensor_file(tensor_path, entry, what, error)
    tensors = _load_tensors(tensor_path, what, error)
    index = {name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()}
    if index != entry["index"]:  # the checksums matched: only a writer bug gets here
        raise error(f"{tensor_path} holds tensors {sorted(index)}, {manifest_path.name} lists {sorted(entry['index'])}")
    return manifest, tensors


def _check_manifest(path: Path, manifest: dict[str, Any], what: str, error: type[Exception]) -> None:
    """The manifest's own checksum, and a tensor entry whose file name stays inside the artifact directory."""
    recorded = manifest.get("manifest_blake2b")
    body = {key: value for key, value in manifest.items() if key != "manifest_blake2b"}
    if not isinstance(recorded, str) or checksum(canonical_json(body)) != recorded:
        raise error(f"{path} was edited or corrupted (its checksum does not match its contents); the {what} "
                    "cannot be trusted: save them again")
    entry = manifest.get("tensors")
    if not isinstance(entry, dict) or not {"file", "bytes", "blake2b", "index"} <= set(entry):
        raise error(f"{path} lists no tensor file; the {what} must be saved again")
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"file", "bytes", "blake2b"} <= set(e)
                                              for e in files.values()):
        raise error(f"{path} lists its files malformed; the {what} must be saved again")
    for role, name in (("tensor", entry["file"]), *((r, e["file"]) for r, e in files.items())):
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise error(f"{path} names the {role} file {name!r}, which is not a file of {path.parent}; refused")


def _check_tensor_file(path: Path, entry: dict[str, Any], what: str, error: type[Exception]) -> None:
    """The tensor file exists, has the recorded size (not truncated) and checksum (not corrupted or replaced)."""
    if not path.is_file():
        raise error(f"{path} is missing (the {what} manifest names it); the {what} must be saved again")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise error(f"{path} has {size} bytes, the manifest records {entry['bytes']} (truncated or replaced); "
                    f"the {what} must be saved again")
    if file_checksum(path) != entry["blake2b"]:
        raise error(f"{path} is corrupted or was replaced (blake2b checksum mismatch); the {what} must be saved "
                    "again")


def _load_tensors(path: Path, what: str, error: type[Exception]) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise error(f"{path} is missing; the {what} must be saved again")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise error(f"{path} is not a readable safetensors file ({' '.join(str(err).split())}); the {what} must "
                    "be saved again") from None


# -- where outputs may go ---------------------------------------------------------------------------
ARTIFACT_MANIFESTS = {"manifest.json": "a gradient store", "scores.json": "saved scores",
                      "curvature.json": "a fitted curvature", "fit.json": "a method fit", "index.json": "an index"}
"""The manifest file of each kind of gradtrace artifact directory, and what it makes the directory."""

_ARTIFACT_FILE = re.compile(r"(scores|curvature|fit|index)(-[a-z_]+)?-[0-9a-f]{16}\.[a-z]+|\.gradtrace-write\.lock"
                            r"|rank-\d{5}\.(json|lock)|gradtrace-[a-z-]+\.yaml")


def artifact_kind(directory: Path) -> str | None:
    """What gradtrace artifact ``directory`` is (``"a gradient store"``, ``"saved scores"``, ...), or None.

    A directory is one when it holds one of :data:`ARTIFACT_MANIFESTS` whose first bytes name a gradtrace
    format (only the first kilobyte is read: a manifest starts with its format)."""
    for name, kind in ARTIFACT_MANIFESTS.items():
        try:
            with open(directory / name, "rb") as f:
                head = f.read(1024)
        except OSError:
            continue
        if b'"gradtrace-' in head:
            return kind
    return None


def refuse_inside_artifact(path: str | Path, what: str, *, own: str | Path | None = None,
                           kinds: tuple[str, ...] | None = None) -> None:
    """Raise :class:`ArtifactError` when writing file ``path`` would put it inside a gradient store or a saved
    artifact (any folder above it), or give it the name of one of an artifact's files.

    ``own``: the directory of the artifact this output belongs to (a report beside its scores), where the file
    may go as long as its name is not one an artifact uses (``scores.json``, ``scores-<hash>.safetensors``, ...).
    ``kinds``: only enclosing artifacts of these kinds (:data:`ARTIFACT_MANIFESTS`' values) are refused (default
    all). Symbolic links are followed, so a link into a store is refused too."""
    target = Path(os.path.realpath(Path(path).expanduser()))
    own_dir = Path(os.path.realpath(Path(own).expanduser())) if own is not None else None
    reserved = target.name in ARTIFACT_MANIFESTS or _ARTIFACT_FILE.fullmatch(target.name)
    if reserved and ((own_dir is not None and target.parent == own_dir) or artifact_kind(target.parent)):
        raise ArtifactError(f"{what} {path} would replace a file of a gradtrace artifact ({target.name}); "
                                "choose another file name or folder")
    for folder in target.parents:
        if own_dir is not None and folder == own_dir:
            continue
        kind = artifact_kind(folder)
        if kind is not None and (kinds is None or kind in kinds):
            raise ArtifactError(f"{what} {path} lies inside {folder}, which is {kind}: gradtrace never writes "
                                "into another artifact; choose a path outside it")
