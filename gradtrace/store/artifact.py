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
import threading
import warnings
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from ..provenance import environment

__all__ = ["ArtifactError", "UncheckedArtifactWarning", "atomic_write_bytes", "atomic_write_json", "canonical_json",
           "checksum", "create_exclusive", "file_checksum", "fsync_dir", "json_bytes", "read_artifact",
           "write_artifact"]

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


def fsync_dir(path: Path) -> None:
    """Fsync a directory (a rename inside it is durable after this); best effort where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_synced(handle: IO[bytes], data: bytes | memoryview) -> None:
    """Write ``data`` to an open file and flush it to the disk."""
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync, rename: readers see all or nothing."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "wb") as f:
            _write_synced(f, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, data: Any) -> None:
    """:func:`atomic_write_bytes` of :func:`json_bytes` ``(data)``."""
    atomic_write_bytes(path, json_bytes(data))


def create_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; False if it did. Other processes never see the
    file half-written: the content is written to a temporary file first and hard-linked into place."""
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            _write_synced(f, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: exclusive create, then write (not atomic)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                _write_synced(f, data)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True



def canonical_json(data: Any) -> bytes:
    """The bytes a checksum of JSON data is taken over: sorted keys, no whitespace, ASCII."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_file_pattern(stem: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(stem)}-[0-9a-f]{{16}}\.safetensors")


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
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_artifact(directory: str | Path, stem: str, fmt: str, version: int, fields: dict[str, Any],
                   tensors: dict[str, Tensor]) -> Path:
    """Save ``tensors`` and the JSON-able ``fields`` as the artifact ``directory/stem.json``; returns its path.

    The tensors are written straight from their memory (``safetensors.torch.save_file``: no serialized copy, so a
    save needs no memory beyond the tensors themselves) to a temporary file, fsynced, hashed by reading it back in
    blocks, and renamed to its content-addressed name. I/O errors (a full disk) propagate as :class:`OSError` after
    the previous artifact, if any, was left intact.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _own_memory(tensors)
    tmp = directory / f".tmp-{stem}-{os.getpid()}-{threading.get_ident()}.safetensors"
    try:
        write_tensors(tmp, tensors)
        digest = file_checksum(tmp)
        tensor_file = directory / f"{stem}-{digest[:16]}.safetensors"
        # a re-save of equal tensors reuses the file the old manifest names -- unless that file was damaged since
        created = not (tensor_file.exists() and file_checksum(tensor_file) == digest)
        if created:
            os.replace(tmp, tensor_file)
            fsync_dir(directory)
    finally:
        tmp.unlink(missing_ok=True)
    index = {name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for name, t in sorted(tensors.items())}
    try:
        record = {"format": fmt, "version": version, "environment": environment(), **fields}
        manifest = json.loads(json.dumps(record))  # keys as they read back
        manifest["tensors"] = {"file": tensor_file.name, "bytes": tensor_file.stat().st_size, "blake2b": digest,
                               "index": index}
        manifest["manifest_blake2b"] = checksum(canonical_json(manifest))
        atomic_write_bytes(directory / f"{stem}.json", json.dumps(manifest, indent=1).encode())
    except BaseException:
        if created:
            tensor_file.unlink(missing_ok=True)
        raise
    _remove_stale(directory, stem, keep=tensor_file.name)
    return directory / f"{stem}.json"


def _remove_stale(directory: Path, stem: str, keep: str) -> None:
    """Remove tensor files of earlier saves (best effort: a leftover file is harmless, never read)."""
    pattern = _tensor_file_pattern(stem)
    for path in directory.iterdir():
        if path.name != keep and (pattern.fullmatch(path.name) or path.name == f"{stem}.safetensors"):
            with contextlib.suppress(OSError):
                path.unlink()


def read_artifact(directory: str | Path, stem: str, fmt: str, version: int, *, what: str, noun: str | None = None,
                  error: type[Exception] = ArtifactError) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The manifest and tensors of the artifact ``directory/stem.json``, verified (see the module docstring).

    what: how messages name the artifact (``"scores"``), noun: as an adjective (``"score"``, default ``what``);
    error: the exception type raised for a corrupted artifact. A missing manifest raises
    :class:`FileNotFoundError`.
    """
    directory = Path(directory)
    manifest_path = directory / f"{stem}.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{directory} holds no saved {what} ({manifest_path.name} missing)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise error(f"{manifest_path} is not readable JSON ({err}); the {what} must be saved again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise error(f"{directory} is not a gradtrace {noun or what} file ({manifest_path.name} has no format {fmt!r})")
    found = manifest.get("version")
    if found == LEGACY_VERSION:
        warnings.warn(f"{directory}: {what} saved by an older gradtrace (version {LEGACY_VERSION}) carry no "
                      "checksums, so corruption cannot be detected; save them again to add checksums",
                      UncheckedArtifactWarning, stacklevel=3)
        return manifest, _load_tensors(directory / f"{stem}.safetensors", what, error)
    if found != version:
        raise error(f"{manifest_path}: {what} of version {found!r}; this gradtrace reads versions "
                    f"{LEGACY_VERSION} and {version} (use the gradtrace that saved them)")
    _check_manifest(manifest_path, manifest, what, error)
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
    name = entry["file"]
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise error(f"{path} names the tensor file {name!r}, which is not a file of {path.parent}; refused")


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
