"""The device <-> host paths of a store (issue #30 item 4): writing rows from a capture, and scoring a store.

1. put: a training-like loop hands ``[batch, dim]`` float32 rows (on ``--device``) to a ``ShardWriter`` of an int8
   store; reports the time the loop spends in ``put`` (what the backward pass waits for), the total until the
   store is closed, and, on CUDA, how many copies went through a pinned buffer. CPU rows are encoded on the calling
   thread (in ``put``); CUDA rows are encoded on the device and copied to a pinned buffer without blocking.
2. score: ``Attributor("grad_dot" / "grad_cos", store).score(queries, topk=100)`` over an int8 store of ``--rows``
   x ``--dim`` (default 200,000 x 1,024), with the next block read ahead on a thread (``prefetch``) and without,
   for 1 and 2 torch threads (``--threads``); best of ``--repeat`` runs; checks the scores are bit-identical.

Usage::

    python bench/d2h.py                       # CPU, 200k x 1024 int8 store
    python bench/d2h.py --device cuda         # the same with CUDA rows and a CUDA scoring device
    python bench/d2h.py --rows 20000 --quick  # a small run
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

import gradtrace
from gradtrace.options import StoreOptions
from gradtrace.store import GradientSpec, GradientStore, ShardWriter

SPEC = dict(projection=None, convention={"reduction": "sum", "example_loss": "sum"}, model={"class": "Bench"})


def build_store(root: Path, rows: int, dim: int, dtype: str = "int8") -> GradientStore:
    if (root / "manifest.json").exists():
        return GradientStore.open(root, verify=False)
    spec = GradientSpec(params=[("w", dim)], dtype=dtype, **SPEC)
    gen = torch.Generator().manual_seed(0)
    with ShardWriter(root, spec, StoreOptions(overwrite=True)) as writer:
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            writer.put([f"t{start + i}" for i in range(n)], torch.randn(n, dim, generator=gen))
    return GradientStore.open(root, verify=False)


def bench_put(root: Path, device: torch.device, batches: int, batch: int, dim: int, work: int) -> dict:
    """A loop of ``batches`` steps: ``work`` matmuls of [batch, dim] (the 'training'), then a put of the rows."""
    spec = GradientSpec(params=[("w", dim)], dtype="int8", **SPEC)
    gen = torch.Generator(device=device).manual_seed(1)
    weight = torch.randn(dim, dim, device=device, generator=gen) / dim**0.5
    rows = torch.randn(batch, dim, device=device, generator=gen)
    in_put = 0.0
    start = time.perf_counter()
    with ShardWriter(root, spec, StoreOptions(overwrite=True)) as writer:
        for step in range(batches):
            for _ in range(work):
                rows = torch.tanh(rows @ weight)
            t0 = time.perf_counter()
            writer.put([f"s{step}-{i}" for i in range(batch)], rows)
            in_put += time.perf_counter() - t0
        pool = writer._pinned
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"put_s": in_put, "total_s": total, "pool": dict(pool.stats) if pool is not None else None}


def bench_score(store: GradientStore, device: torch.device, threads: int, prefetch: bool, method: str,
                queries: gradtrace.GradientSet, repeat: int) -> tuple[float, gradtrace.Scores]:
    torch.set_num_threads(threads)
    best, scores = float("inf"), None
    for _ in range(repeat):
        attributor = gradtrace.Attributor(method, store, device=device)
        attributor.prefetch = prefetch
        t0 = time.perf_counter()
        scores = attributor.score(queries, topk=100, matrix=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the store is kept between runs (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="fewer put steps")
    args = parser.parse_args()
    device = torch.device(args.device)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gradtrace-d2h-"))
    print(f"# d2h bench: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")

    steps = 20 if args.quick else 100
    put = bench_put(base / "put", device, steps, 64, args.dim, work=4)
    print(f"put: {steps} batches of 64 x {args.dim} float32 -> int8: {put['put_s'] * 1e3:.1f} ms in put "
          f"({put['put_s'] / steps * 1e3:.2f} ms/batch), {put['total_s']:.2f} s until closed; pool {put['pool']}")

    t0 = time.perf_counter()
    store = build_store(base / f"int8-{args.rows}x{args.dim}", args.rows, args.dim)
    print(f"store: {len(store):,} x {store.dim} int8 ({time.perf_counter() - t0:.1f} s to build or open)")
    gen = torch.Generator().manual_seed(2)
    spec = GradientSpec(params=[("w", args.dim)], **SPEC)
    queries = gradtrace.GradientSet(torch.randn(args.queries, args.dim, generator=gen),
                                    [f"q{i}" for i in range(args.queries)], spec)
    for method in ("grad_dot", "grad_cos"):
        for threads in [int(t) for t in args.threads.split(",")]:
            plain_s, plain = bench_score(store, device, threads, False, method, queries, args.repeat)
            ahead_s, ahead = bench_score(store, device, threads, True, method, queries, args.repeat)
            same = torch.equal(plain.top[0], ahead.top[0]) and torch.equal(plain.top[1], ahead.top[1])
            print(f"score {method}, {threads} thread(s), Q={args.queries}, topk=100: in place {plain_s:.2f} s "
                  f"({len(store) / plain_s:,.0f} rows/s), prefetch {ahead_s:.2f} s ({len(store) / ahead_s:,.0f} "
                  f"rows/s): x{plain_s / ahead_s:.2f}; scores {'bit-identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
