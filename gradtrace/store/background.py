"""The background thread of a store writer: the backward pass hands rows to a bounded queue and never waits on
disk unless the queue is full (a disk slower than training applies back-pressure instead of filling memory).

An error in the thread (a full disk, a vanished directory) is kept in :attr:`BackgroundWriter.error` for the
producer to raise at its next call; the thread then drains the queue so that a producer blocked on it returns.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Runs ``write(item)`` on a thread for each queued item, in order; ``finish()`` after the last one (at
    :meth:`close`), ``abandon()`` after a failure."""

    def __init__(self, write: Callable[[Any], None], finish: Callable[[], None], abandon: Callable[[], None], *,
                 queue_size: int, name: str) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be positive")
        self._write, self._finish, self._abandon = write, finish, abandon
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        """Queue ``item`` (blocks while the queue is full). Check :attr:`error` afterwards: an item queued while
        the thread failed is not written."""
        self._queue.put(item)

    def close(self) -> None:
        """Let the thread write what is queued, run ``finish()``, and wait for it (no-op work after a failure)."""
        if self.error is None:
            self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    self._finish()
                    return
                self._write(item)
        except BaseException as err:  # surfaced to the producer by its next call
            self.error = err
            self._abandon()
            while True:  # drain so that a blocked put() returns and sees the error
                try:
                    if self._queue.get_nowait() is None:
                        break
                except queue.Empty:
                    break
