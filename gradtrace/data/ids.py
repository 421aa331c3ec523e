"""Example identity: the one content-hash id rule, shared by ``gradtrace.data``, the capture and the Trainer callback.

An example without a user id is identified by a hash of its unpadded tokens (:func:`content_hash`: 16 hex
digits over the array's dtype and bytes). The ``n``-th repeat of the same content in one pass gets ``#n``
appended (:class:`ContentIds`), so two equal documents stay two examples. The data layer, the capture
(``gradtrace.capture``, hence ``collect`` and the Hugging Face Trainer callback with ``ids=None``) and the
command line all number ids here, so a store written by any of them joins the others' ids.

This module imports nothing else of gradtrace: the capture imports it without importing the data layer's
readers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

__all__ = ["ContentIds", "content_hash"]


def content_hash(array: np.ndarray) -> str:
    """A 16-hex-digit content hash of an array's dtype and bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(array.dtype).encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


class ContentIds:
    """Numbers repeats of content digests: the first is the digest itself, the ``n``-th repeat ``digest#n``.

    One instance spans one pass over the data (a file, an epoch); :meth:`reset` starts a new pass, in which
    repeated content is the same example again.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def number(self, digests: Iterable[str]) -> list[str]:
        """The ids of ``digests``, in order, counting them as seen."""
        ids = []
        for digest in digests:
            seen = self._counts.get(digest, 0)
            self._counts[digest] = seen + 1
            ids.append(digest if seen == 0 else f"{digest}#{seen}")
        return ids

    def reset(self) -> None:
        """Forget the digests seen (a new pass)."""
        self._counts.clear()
