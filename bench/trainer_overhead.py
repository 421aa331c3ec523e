"""Overhead of ``GradtraceCallback`` in a Hugging Face ``Trainer``: time per optimizer step and peak memory.

A random-init GPT-2 (default: 4 layers, width 256, an 8,192-token vocabulary, 128 tokens per sequence) is
trained by ``transformers.Trainer`` (AdamW, fp32, batch 8, 2 accumulation steps) in three modes:

* ``plain``   -- no callback
* ``exact``   -- ``GradtraceCallback`` storing every example's exact gradient (no projection; float32 store)
* ``logra16`` -- ``GradtraceCallback(projection=LoGra(rank=16))``

Each mode runs in a process of its own; the modes take turns (``--rounds`` times) so that machine drift hits
all of them alike, and the median step time over all rounds is reported. A step is timed from the first
callback's ``on_step_begin`` to the last callback's ``on_step_end``, so it includes opening and closing the
capture, the per-example work in the backward pass and handing rows to the store writer (whose disk writes run
in a background thread). Peak memory is the process's peak resident set above its level after the warm-up steps.

    python bench/trainer_overhead.py                         # default configuration
    python bench/trainer_overhead.py --layers 2 --width 128 --steps 4 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from gradtrace.options import CaptureOptions

MODES = ("plain", "exact", "logra16")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_mode(args: argparse.Namespace) -> dict:
    """Train ``warmup + steps`` optimizer steps in this process, in ``args.mode``; return its measurements."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import gradtrace
    from gradtrace.integrations.hf import GradtraceCallback

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), n_positions=args.seq,
                     vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(cfg)
    total_steps = args.warmup + args.steps
    count = total_steps * args.batch * args.accum
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (count, args.seq), generator=generator)
    data = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})

    times: list[float] = []
    marks: dict[str, float] = {}

    class Start(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.warmup:
                marks["base_rss"] = _rss_mb()
            marks["t0"] = time.perf_counter()

    class Stop(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step > args.warmup:
                times.append(time.perf_counter() - marks["t0"])

    callbacks: list = [Start()]
    with tempfile.TemporaryDirectory(prefix="gradtrace-bench-") as tmp:
        if args.mode != "plain":
            projection = gradtrace.LoGra(rank=16) if args.mode == "logra16" else None
            callbacks.append(GradtraceCallback(os.path.join(tmp, "store"),
                                               options=CaptureOptions(projection=projection)))
        callbacks.append(Stop())
        training = TrainingArguments(os.path.join(tmp, "out"), per_device_train_batch_size=args.batch,
                                     gradient_accumulation_steps=args.accum, max_steps=total_steps, learning_rate=1e-4,
                                     lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                                     logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
        trainer.train()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        dim = None
        if args.mode != "plain":
            store = callbacks[1].result()
            dim = store.dim
    return {"mode": args.mode, "times": times, "peak_over_start_mb": peak - marks["base_rss"], "dim": dim,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    import torch
    import transformers

    print(f"# host: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__} ({args.threads} threads), "
          f"transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"# GPT-2 {args.layers} layers, width {args.width}, vocab {args.vocab}; {args.seq} tokens x batch "
          f"{args.batch} x {args.accum} accumulation steps = {args.seq * args.batch * args.accum} tokens per "
          f"optimizer step; fp32, AdamW, CPU; median of {args.steps} steps x {args.rounds} rounds after "
          f"{args.warmup} warm-up steps, each mode in its own process")
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--mode", mode] + [
                f"--{k}={getattr(args, k)}" for k in ("layers", "width", "vocab", "seq", "batch", "accum", "steps",
                                                       "warmup", "threads")]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"mode {mode} failed:\n{out.stderr[-3000:]}")
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = results[args.modes[0]][0]
    print(f"# {first['params_m']:.2f}M parameters")
    step = {m: statistics.median([t for r in runs for t in r["times"]]) for m, runs in results.items()}
    peak = {m: statistics.median([r["peak_over_start_mb"] for r in runs]) for m, runs in results.items()}
    base = "plain" if "plain" in step else args.modes[0]
    print(f"\n{'mode':<9} {'store dim':>10} {'s/step':>8} {'ratio':>6} {'peak MB':>8} {'peak/plain':>10}")
    for mode in args.modes:
        dim = results[mode][0]["dim"]
        mem_ratio = peak[mode] / peak[base] if peak[base] > 0 else float("nan")
        print(f"{mode:<9} {dim if dim else '-':>10} {step[mode]:>8.3f} {step[mode] / step[base]:>6.2f} "
              f"{peak[mode]:>8.0f} {mem_ratio:>10.2f}")


if __name__ == "__main__":
    main()
