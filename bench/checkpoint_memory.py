"""Peak memory of one training step with non-reentrant gradient checkpointing, with and without capture.

A random-init Hugging Face GPT-2 or Llama (default: 8 layers, width 512, 8 heads, a 2,048-token vocabulary, SDPA
attention, float32) takes one step on ``batch x length`` random tokens (default 8 x 512) with the model's own
token-mean loss, in one of these modes:

* ``plain``        -- forward + backward, no checkpointing, no capture
* ``ckpt``         -- ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
* ``ckpt+exact``   -- checkpointed, under ``gradtrace.capture`` (factorized per-token per-example gradients)
* ``ckpt+logra``   -- checkpointed, under capture with ``LoGra(rank=16)``
* ``exact``, ``logra`` -- the same captures without checkpointing

Each mode runs in a fresh process on one thread with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``), so that freed activations leave the resident set at once. A warm-up step on one
16-token row allocates the gradients (kept, zeroed), the LoGra matrices and the threads; the *step peak* is the
process's ``ru_maxrss`` after the measured step minus its resident memory before it: activations, temporaries and
what the capture holds, above the weights, their gradients and the interpreter. ``captured`` is the size of the
step's ``GradientBatch`` (per-token factors for the exact capture: the capture's product, which the step's backward
pass holds until it ends). Usage::

    python bench/checkpoint_memory.py                    # GPT-2, every mode, a markdown table
    python bench/checkpoint_memory.py --arch llama --modes ckpt ckpt+logra
    python bench/checkpoint_memory.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

MODES = ("plain", "ckpt", "ckpt+exact", "ckpt+logra", "exact", "logra")

CHILD = """
import gc, json, resource, sys
import torch
import gradtrace
from gradtrace.grad.terms import term_tensors
from gradtrace.options import CaptureOptions, Loss

case = json.loads(sys.argv[1])
mode = case["mode"]
torch.manual_seed(0)
torch.set_num_threads(1)
h, n, v, b, t = case["hidden"], case["layers"], case["vocab"], case["batch"], case["length"]
if case["arch"] == "gpt2":
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=v, n_positions=t, n_embd=h, n_layer=n, n_head=case["heads"],
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0))
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=int(2.6875 * h),
                                         num_hidden_layers=n, num_attention_heads=case["heads"],
                                         num_key_value_heads=case["heads"], max_position_embeddings=t,
                                         bos_token_id=0, eos_token_id=0))
model.train()
if mode.startswith("ckpt"):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
captured = []

def on_batch(batch):  # measure (each storage once: terms share factors), then drop (as a store writer would)
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for pg in batch.params.values()
                for term in pg.terms for x in term_tensors(term).values()}
    captured.append(sum(storages.values()))

def step(rows, length):
    ids = torch.randint(1, v, (rows, length))
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    for p in model.parameters():
        p.grad.zero_()

kind = mode.split("+")[-1]
if kind in ("exact", "logra"):
    projection = gradtrace.LoGra(rank=case["rank"]) if kind == "logra" else None
    cap = gradtrace.capture(model, Loss(reduction="token_mean"), options=CaptureOptions(projection=projection),
                            callbacks=[on_batch])
else:
    cap = None
if cap is not None:
    cap.__enter__()
step(1, 16)
captured.clear()
gc.collect()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
step(b, t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if cap is not None:
    cap.__exit__(None, None, None)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({**case, "step_peak": peak - before, "process_peak": peak, "before": before,
                  "weights": weights, "captured": captured[0] if captured else 0, "torch": torch.__version__}))
"""


def measure(case: dict) -> dict:
    """One mode in a fresh process: ``{..., "step_peak": bytes, "captured": bytes, ...}``."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                            env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{case['mode']} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16, help="LoGra rank of the logra modes")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", action="store_true", help="one JSON object per mode instead of a table")
    args = parser.parse_args()
    shape = {k: getattr(args, k) for k in ("arch", "layers", "hidden", "heads", "vocab", "batch", "length", "rank")}
    rows = []
    for mode in args.modes:
        rows.append(measure({**shape, "mode": mode}))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        return
    mib = 2 ** 20
    ckpt = next((r["step_peak"] for r in rows if r["mode"] == "ckpt"), None)
    print(f"# {args.arch} L={args.layers} h={args.hidden} heads={args.heads} V={args.vocab}, {args.batch} x "
          f"{args.length} tokens, float32, LoGra rank {args.rank}; {platform.machine()} CPU, one thread, python "
          f"{platform.python_version()}, torch {rows[0]['torch']}; weights {rows[0]['weights'] / mib:.0f} MiB")
    print("| mode | step peak | / ckpt | captured | (step peak - captured) / ckpt | process peak |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['step_peak'] / ckpt:.2f}" if ckpt else "-"
        net = f"{(r['step_peak'] - r['captured']) / ckpt:.2f}" if ckpt else "-"
        print(f"| {r['mode']} | {r['step_peak'] / mib:.0f} MiB | {ratio} | {r['captured'] / mib:.1f} MiB | {net} | "
              f"{r['process_peak'] / mib:.0f} MiB |")


if __name__ == "__main__":
    main()
