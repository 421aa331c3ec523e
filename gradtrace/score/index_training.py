"""Choosing and training an index for a store's size: ``kind="auto"``, and FAISS's training warnings said once.

A small store gains nothing from IVF-PQ: its 8-bit codebooks (256 centroids per sub-quantizer, trained on
FAISS's recommended 39 rows per centroid) need about 10,000 training rows, and below that the codebooks alone
(``256 x dim`` floats) and the coarse quantizer make the index larger than a flat copy of the rows -- a 316-row
store of 2.5 MiB got an 8 MiB index, and FAISS printed one ``WARNING clustering ... please provide at least ...``
line per sub-quantizer (489 of them). :func:`auto_kind` picks ``flat`` (exact, ``rows x dim x 4`` bytes) below
:data:`AUTO_FLAT_ROWS` rows and ``ivfpq`` from there, and says why; :func:`faiss_warnings_once` captures what
FAISS writes to the process's stderr while it trains and reports it as one :class:`FaissTrainingWarning`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = ["AUTO_FLAT_ROWS", "FaissTrainingWarning", "auto_kind", "faiss_warnings_once"]

AUTO_FLAT_ROWS = 10_000
"""``kind="auto"`` builds a flat index below this many rows: about the 39 x 256 = 9,984 training rows 8-bit PQ
codebooks need, and the size at which a flat copy of the rows stops being smaller than an IVF-PQ index's codebooks
and quantizer for most dimensions."""

_CLUSTERING = re.compile(r"WARNING clustering (\d+) points to (\d+) centroids")


class FaissTrainingWarning(UserWarning):
    """FAISS warned while training an index (too few training rows for its centroids), said once."""


def auto_kind(rows: int, *ivfpq_settings: Any) -> tuple[str, str]:
    """``(kind, why)`` for ``kind="auto"``: ``"ivfpq"`` from :data:`AUTO_FLAT_ROWS` rows, or when one of the
    IVF-PQ settings (nlist, m, nbits, fast_scan) is given (not None), else ``"flat"``."""
    if any(setting is not None for setting in ivfpq_settings):
        return "ivfpq", "an IVF-PQ setting was given"
    if rows >= AUTO_FLAT_ROWS:
        return "ivfpq", f"{rows:,} rows, at least {AUTO_FLAT_ROWS:,}: compact product-quantized rows"
    return "flat", (f"{rows:,} rows, fewer than {AUTO_FLAT_ROWS:,}: exact, and smaller than an ivfpq index (whose "
                    "codebooks need about 10,000 training rows)")


@contextlib.contextmanager
def faiss_warnings_once(what: str) -> Iterator[None]:
    """Capture what FAISS prints on the process's stderr (file descriptor 2) inside; afterwards its repeated
    clustering warnings become one :class:`FaissTrainingWarning` (each distinct line with its count, ``what``
    naming the training), and any other output is written back to stderr as it was. Where descriptor 2 cannot be
    redirected, FAISS prints as usual."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as captured:
        try:
            os.dup2(captured.fileno(), 2)
        except OSError:
            os.close(saved)
            yield
            return
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            output = captured.read().decode("utf-8", errors="replace")
    _report(output, what)


def _report(output: str, what: str) -> None:
    lines = output.splitlines()
    counts = Counter(line.strip() for line in lines if _CLUSTERING.search(line))
    others = [line for line in lines if not _CLUSTERING.search(line)]
    if others:
        with contextlib.suppress(OSError, ValueError):
            os.write(2, ("\n".join(others) + "\n").encode())
    if not counts:
        return
    total = sum(counts.values())
    said = "; ".join(f"{line}{f' (x{n})' if n > 1 else ''}" for line, n in counts.most_common(3))
    more = f"; and {len(counts) - 3} other lines" if len(counts) > 3 else ""
    warnings.warn(f"FAISS warned {total} time{'s' if total > 1 else ''} while training {what}: {said}{more}. Its "
                  "centroids are trained on fewer rows than FAISS recommends (39 per centroid), so the shortlist may "
                  "miss rows; a flat index (kind flat) is exact and small at this size", FaissTrainingWarning,
                  stacklevel=5)  # _report, this generator, contextlib, build_index: its caller
