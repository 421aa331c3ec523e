"""Run a function on every rank of a fresh 2-process gloo group (CPU), and get each rank's result back.

``run_ranks(fn, *args)`` starts the ranks (forked from a ``forkserver`` that has imported torch and gradtrace
once; one thread each), joins them in a process group rendezvoused through a file (no port to race for;
gloo picks its own free ports), calls ``fn(rank, world_size, *args)`` on each, and returns the results in
rank order. A rank that raises fails
the test with its traceback; a run that is not finished after ``timeout`` seconds is killed and reported as
a hang. ``fn`` must be importable (a module-level function of ``tests.distributed.jobs``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


class RankError(AssertionError):
    pass


def _entry(fn: Callable, rank: int, world: int, rendezvous: str, out: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        outcome = ("ok", fn(rank, world, *args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    torch.save(outcome, Path(out) / f"rank{rank}.pt")
    # no rank leaves while another one still talks to it (gloo would see "connection closed by peer")
    with contextlib.suppress(Exception):
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    dist.destroy_process_group()


def _context():
    """``forkserver`` with torch and gradtrace preloaded: each rank forks from a clean server process that has
    imported them once (no threads, no torch ops run), instead of a fresh interpreter importing them again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "gradtrace", "tests.distributed.jobs",
                                "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"])
    return ctx


class Ranks:
    """Rank processes started by :func:`start_ranks`; :meth:`wait` for their results."""

    def __init__(self, fn: Callable, args: tuple, world: int) -> None:
        self.fn = fn
        self._tmp = tempfile.TemporaryDirectory(prefix="gradtrace-dist-")
        ctx = _context()
        rendezvous = os.path.join(self._tmp.name, "rendezvous")
        self.procs = [ctx.Process(target=_entry, args=(fn, r, world, rendezvous, self._tmp.name, args), daemon=True)
                      for r in range(world)]
        for proc in self.procs:
            proc.start()

    def wait(self, timeout: float = 60, may_die: tuple[int, ...] = ()) -> list[Any]:
        """Results in rank order; ranks in ``may_die`` may end without one (None)."""
        try:
            deadline = time.monotonic() + timeout
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, proc in enumerate(self.procs) if proc.is_alive()]
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if hung:
                raise RankError(f"{self.fn.__name__}: ranks {hung} did not finish within {timeout} s (a hang)")
            results, errors = [], []
            for r, proc in enumerate(self.procs):
                path = Path(self._tmp.name) / f"rank{r}.pt"
                if not path.exists():
                    if r not in may_die:
                        errors.append(f"rank {r} exited with code {proc.exitcode} and no result")
                    results.append(None)
                    continue
                status, value = torch.load(path, weights_only=False)  # written by our own rank processes
                if status == "error":
                    errors.append(f"rank {r} raised:\n{value}")
                results.append(value)
            if errors:
                raise RankError(f"{self.fn.__name__}:\n" + "\n".join(errors))
            return results
        finally:
            self._tmp.cleanup()


def start_ranks(fn: Callable, *args: Any, world: int = 2) -> Ranks:
    """Start ``fn(rank, world, *args)`` on ``world`` ranks without waiting for them."""
    return Ranks(fn, args, world)


def run_ranks(fn: Callable, *args: Any, world: int = 2, timeout: float = 60, may_die: tuple[int, ...] = ()
              ) -> list[Any]:
    """``[fn(0, world, *args), fn(1, world, *args), ...]``, each computed in its own rank process."""
    return start_ranks(fn, *args, world=world).wait(timeout, may_die)
