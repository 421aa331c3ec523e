"""A store's manifest read and checked: one rule (format, schema version, checksum) for readers and writers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from .layout import FORMAT, MANIFEST, READABLE_VERSIONS, SCHEMA_VERSION, StoreError, manifest_checksum

__all__ = ["check_manifest", "read_manifest"]


def read_manifest(root: Path) -> dict[str, Any]:
    """The parsed manifest of the store at ``root``, checked for reading (:func:`check_manifest`)."""
    if not root.is_dir():
        raise StoreError(f"{root} is not a gradient store (no such directory)")
    manifest_path = root / MANIFEST
    if not manifest_path.exists():
        raise StoreError(f"{root} is not a gradient store (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise StoreError(f"{manifest_path} is corrupted: {err}") from None
    return check_manifest(root, manifest, "read")


def check_manifest(root: Path, manifest: Any, purpose: Literal["read", "write"], *,
                   format_only: bool = False) -> dict[str, Any]:
    """``manifest`` (parsed from ``root``'s manifest file) if it is a gradtrace store's that can be read
    (``purpose="read"``: schema 1 or 2) or written to (``"write"``: this gradtrace's schema) with (from schema 2
    on) a checksum that matches its content; ``format_only``: only the first check (a store to be replaced). The
    one format check of the reader and the writer; each error names what to do for ``purpose``."""
    writing = purpose == "write"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise StoreError(f"{root} is not a gradtrace store ({MANIFEST} has format {found!r})"
                         f"{'; choose another directory' if writing else ''}")
    if format_only:
        return manifest
    version = manifest.get("schema_version")
    if version not in ((SCHEMA_VERSION,) if writing else READABLE_VERSIONS):
        if writing:
            older = " (an older gradtrace's store: readable, but not resumable)" if version in READABLE_VERSIONS else ""
            raise StoreError(f"{root} has schema version {version}{older}, this gradtrace writes version "
                             f"{SCHEMA_VERSION}; write to a new directory or pass overwrite=True")
        raise StoreError(f"{root} has schema version {version}, this gradtrace reads version "
                         f"{' or '.join(map(str, READABLE_VERSIONS))}")
    if version >= 2 and manifest.get("checksum") != manifest_checksum(manifest):
        todo = ("restore it, or pass overwrite=True to replace the store" if writing else
                "its gradients would be read with the wrong settings. Restore the original file or collect the "
                "store again")
        raise StoreError(f"{root / MANIFEST} was edited or is corrupted (its checksum does not match its content: "
                         f"spec, projection seed, model, dtype...); {todo}")
    return manifest
