"""Capture overhead: time per training step and peak memory, with and without gradtrace.

For a random-init GPT-2 (default: 4 layers, width 256, 128 tokens, batch 16, GPT-2's 50,257-token vocabulary):

* ``plain``   -- forward + backward + AdamW step
* ``exact``   -- the same under ``gradtrace.capture`` (factorized per-example gradients, no projection)
* ``logra8``  -- capture with ``LoGra(rank=8)``
* ``logra32`` -- capture with ``LoGra(rank=32)``

Captured batches are handed to a callback that drops them (as a store writer would consume them), so the
numbers include building each ``GradientBatch``. Time per step is measured in one process with the modes taking
turns step by step (so machine drift hits all modes alike); peak memory is measured with each mode in a
process of its own. Usage::

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

from gradtrace.options import CaptureOptions, Loss

MODES = ("plain", "exact", "logra8", "logra32")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _setup(args: argparse.Namespace):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

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

    return model, step, batches


def _capture(model, mode: str, sink: list):
    import gradtrace

    if mode == "plain":
        return None
    projection = {"logra8": gradtrace.LoGra(rank=8), "logra32": gradtrace.LoGra(rank=32)}.get(mode)
    return gradtrace.capture(model, loss=Loss(reduction="token_mean"),
                             callbacks=[lambda batch: sink.append(len(batch))],
                             options=CaptureOptions(projection=projection))


def time_modes(args: argparse.Namespace) -> dict:
    """Median seconds per step of every mode, the modes taking turns step by step."""
    model, step, batches = _setup(args)
    sink: list = []
    captures = {mode: _capture(model, mode, sink) for mode in MODES}
    times = {mode: [] for mode in MODES}
    step(batches[0])
    for i in range(args.warmup + args.steps):
        for mode in MODES:
            cap = captures[mode]
            if cap is not None:
                cap.__enter__()
            t0 = time.perf_counter()
            step(batches[i % 2])
            elapsed = time.perf_counter() - t0
            if cap is not None:
                cap.__exit__(None, None, None)
            if i >= args.warmup:
                times[mode].append(elapsed)
    assert sum(sink) == args.batch * (args.warmup + args.steps) * (len(MODES) - 1)
    return {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}


def peak_one(args: argparse.Namespace) -> dict:
    """Peak resident memory above the post-warm-up level, for one mode in this process."""
    model, step, batches = _setup(args)
    step(batches[0])  # optimizer state and allocator warm-up before measuring memory
    base_rss = _rss_mb()
    sink: list = []
    cap = _capture(model, args.mode, sink)
    if cap is not None:
        cap.__enter__()
    for i in range(2):
        step(batches[i % 2])
    if cap is not None:
        cap.__exit__(None, None, None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "peak_over_start_mb": peak - base_rss,
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
        print(json.dumps(peak_one(args)))
        return
    configs = [(args.layers, args.width)] if args.layers else [(4, 256), (8, 512)]
    print(f"# host: {platform.machine()} {os.cpu_count()} cpus, torch threads {args.threads}, python "
          f"{platform.python_version()}; seq {args.seq}, batch {args.batch}, vocab {args.vocab}, fp32, AdamW; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    for layers, width in configs:
        args.layers, args.width = layers, width
        times = time_modes(args)
        peaks = {}
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--layers", str(layers), "--width", str(width),
                   "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\nGPT-2 {layers} layers, width {width} ({peaks['plain']['params_m']:.1f}M params)")
        print(f"{'mode':<9} {'s/step':>8} {'ratio':>6} {'peak MB':>8} {'peak/plain':>10}")
        base_mem = peaks["plain"]["peak_over_start_mb"]
        for mode in MODES:
            mem = peaks[mode]["peak_over_start_mb"]
            print(f"{mode:<9} {times[mode]:>8.3f} {times[mode] / times['plain']:>6.2f} {mem:>8.0f} "
                  f"{mem / base_mem:>10.2f}")

if __name__ == "__main__":
    main()
