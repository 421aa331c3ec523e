"""What identifies a store's content: :func:`store_fingerprint` (from the manifest and shard records, no row is
re-read), and a few words on how two fingerprints differ. An index (:mod:`gradtrace.score.index`) and a dual TRAK
fit (:mod:`gradtrace.fit.methods.trak`) record the fingerprint of the store they read and refuse one that changed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["fingerprint_difference", "store_fingerprint"]

def store_fingerprint(store: Any) -> dict[str, Any]:
    """What identifies a store's content, from what :class:`GradientStore` exposes (no data is re-read).

    ``{"spec", "rows", "shards": [{name, rows, files: {key: blake2b}}], "ids", "digest"}``: the manifest's
    gradient spec, the row count, every committed shard with its files' checksums in row order, a hash of
    the row ids, and one digest over all of it. Two stores with the same digest hold the same rows in the
    same order (their shard checksums agree); a copied or moved store keeps its digest.
    """
    shards = [{"name": s.name, "rows": int(s.rows),
               "files": {key: info.get("blake2b") for key, info in sorted(s.record.get("files", {}).items())}}
              for s in store.shards]
    ids = hashlib.blake2b("\n".join(store.ids).encode(), digest_size=16).hexdigest()
    body = {"spec": store.spec.to_dict(), "rows": len(store), "shards": shards, "ids": ids}
    digest = hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    return {**body, "digest": digest}


def fingerprint_difference(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """A few words on how two fingerprints differ (for the refusal message)."""
    if recorded.get("spec") != current.get("spec"):
        return "its gradients have another layout, model or projection"
    if recorded.get("rows") != current.get("rows"):
        return f"it held {recorded.get('rows')} rows, it now holds {current.get('rows')}"
    old = {s["name"]: s for s in recorded.get("shards", [])}
    changed = [s["name"] for s in current.get("shards", []) if old.get(s["name"]) != s]
    if changed:
        return f"shard {changed[0]} differs"
    return "its row ids differ"
