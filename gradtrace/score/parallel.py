"""Independent chunks of CPU scoring work on a small pool of one-thread workers, results in chunk order.

Small memory-bound operations (decoding a few thousand gathered rows, a ``[8, D] x [D, sub]`` product, a top-k)
parallelize badly inside torch: every operation forks and joins all intra-op threads, and on a shared machine each
join waits for a busy core. :func:`map_chunks` runs whole chunks instead, one per worker thread, each worker with
one intra-op thread (``torch.set_num_threads(1)`` is per OS thread: the caller's count is left as it was) and its
own scratch state (a decode buffer sized as for one thread). numpy copies and torch operations release the GIL.

A chunk's result must not depend on which worker ran it or on how many there are: the caller's ``work`` reads the
chunk and its worker's scratch only, and the scratch is built the same way in every worker and in the sequential
path, so the output is identical whatever the number of workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["chunk_workers", "map_chunks"]

Task = TypeVar("Task")
Scratch = TypeVar("Scratch")
Result = TypeVar("Result")


def chunk_workers(device: torch.device) -> int:
    """Workers for chunk-parallel scoring on ``device``: torch's intra-op thread count on the CPU (the threads the
    caller allows), 1 elsewhere (a CUDA device runs its chunks in order: the device, not the host, does the work)."""
    return max(1, torch.get_num_threads()) if device.type == "cpu" else 1


def map_chunks(tasks: Sequence[Task], work: Callable[[Task, Scratch], Result], scratch: Callable[[], Scratch],
               workers: int) -> list[Result]:
    """``[work(task, s) for task in tasks]``, ``s`` a worker's own ``scratch()``, on ``workers`` threads.

    With ``workers <= 1`` the tasks run in order in the calling thread, with one ``scratch()`` built there (under
    the caller's thread count). Otherwise (even for a single task, so that every task's math is the same whatever
    ``workers``) each of ``min(workers, len(tasks))`` worker threads first sets its own torch thread
    count to 1, then builds its scratch (so that a scratch sized by ``torch.get_num_threads()`` is sized as for one
    thread), and takes the next task. Results come back in task order; the first failing task's exception is raised
    unchanged (tasks not started yet are cancelled, running ones finish first).
    """
    if workers <= 1 or not tasks:
        own = scratch()
        return [work(task, own) for task in tasks]
    local = threading.local()

    def run(task: Task) -> Result:
        if not hasattr(local, "scratch"):
            torch.set_num_threads(1)  # this worker thread only
            local.scratch = scratch()
        return work(task, local.scratch)

    pool = ThreadPoolExecutor(max_workers=min(workers, len(tasks)), thread_name_prefix="gradtrace-chunk")
    try:
        futures = [pool.submit(run, task) for task in tasks]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
