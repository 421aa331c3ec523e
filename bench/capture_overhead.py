"""Capture overhead: time per training step and peak memory, with and without gradtrace.

For a random-init GPT-2 (default: 4 layers, width 256, 128 tokens, batch 16, GPT-2's 50,257-token vocabulary),
each mode runs in its own process so that peak memory is that mode's own:

* ``plain``   -- forward + backward + AdamW step
* ``exact``   -- the same under ``gradtrace.capture`` (factorized per-example gradients, no projection)
* ``logra8``  -- capture with ``LoGra(rank=8)``
* ``logra32`` -- capture with ``LoGra(rank=32)``

Captured batches are handed to a callback that drops them (as a store writer would consume them), so the
numbers include building each ``GradBatch``. Usage::

    python bench/capture_overhead.py                    # default and larger configuration
    python bench/capture_overhead.py --layers 4 --width 256 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

MODES = ("plain", "exact", "logra8", "logra32")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(args: argparse.Namespace) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradtrace

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), n_positions=args.seq,
                     vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq)) for _ in range(2)]

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])  # optimizer state and allocator warm-up before measuring memory
    base_rss = _rss_mb()
    mode = args.mode
    projection = {"logra8": gradtrace.LoGra(rank=8), "logra32": gradtrace.LoGra(rank=32)}.get(mode)
    seen = []

    def consume(batch):
        seen.append(len(batch))

    if mode == "plain":
        ctx = None
    else:
        ctx = gradtrace.capture(model, reduction="token_mean", projection=projection, callbacks=[consume])
        ctx.__enter__()
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(batches[i % 2])
        times.append(time.perf_counter() - t0)
    if ctx is not None:
        ctx.__exit__(None, None, None)
        assert sum(seen) == args.batch * (args.warmup + args.steps)
    times = sorted(times[args.warmup:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "median_s": times[len(times) // 2], "min_s": times[0],
            "peak_rss_mb": peak, "peak_over_start_mb": peak - base_rss,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_one(args)))
        return
    configs = [(args.layers, args.width)] if args.layers else [(4, 256), (8, 512)]
    print(f"# host: {platform.machine()} {os.cpu_count()} cpus, torch threads {args.threads}, python "
          f"{platform.python_version()}; seq {args.seq}, batch {args.batch}, vocab {args.vocab}, fp32, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    for layers, width in configs:
        rows = []
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--layers", str(layers), "--width", str(width),
                   "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        plain = rows[0]
        print(f"\nGPT-2 {layers} layers, width {width} ({plain['params_m']:.1f}M params)")
        print(f"{'mode':<9} {'s/step':>8} {'ratio':>6} {'peak MB':>8} {'peak/plain':>10}")
        for r in rows:
            print(f"{r['mode']:<9} {r['median_s']:>8.3f} {r['median_s'] / plain['median_s']:>6.2f} "
                  f"{r['peak_over_start_mb']:>8.0f} {r['peak_over_start_mb'] / plain['peak_over_start_mb']:>10.2f}")


if __name__ == "__main__":
    main()
