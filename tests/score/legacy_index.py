"""Indexes as gradtrace version 1 saved them (before checksums), for the tests of loading old indexes.

Version 1: ``index.json`` (format, version 1, params, rows, dim, metric, fingerprint, meta and, from a later
0.x on, a ``row_norms`` record of size and checksum), ``index.faiss`` and ``row_norms.npy`` beside it.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from gradtrace.store.artifact import checksum


def save_v1(index, where: Path, *, norms: bool = True) -> Path:
    """Write ``index`` in the version-1 layout; ``norms=False``: as saved before row norms were recorded."""
    import faiss

    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index.faiss_index, str(where / "index.faiss"))
    info = {"format": "gradtrace-index", "version": 1, "params": asdict(index.params), "rows": len(index),
            "dim": index.dim, "metric": "inner_product", "fingerprint": index.fingerprint, "meta": index.meta}
    if norms and index.row_norms is not None:
        buffer = io.BytesIO()
        np.save(buffer, index.row_norms.numpy(), allow_pickle=False)
        data = buffer.getvalue()
        (where / "row_norms.npy").write_bytes(data)
        info["row_norms"] = {"file": "row_norms.npy", "rows": len(index), "bytes": len(data), "blake2b": checksum(data)}
    (where / "index.json").write_text(json.dumps(info, indent=1))
    return where
