"""The collect plan's memory estimate against the measured peak of one capture step, on the CPU.

Each case runs in a fresh process: a random-init GPT-2 or Llama of the given shape, one warm-up step on a
single example (threads, LoGra matrices), then one ``gradtrace.collect`` step of ``batch x length`` random tokens.
The measured peak is the process's ``ru_maxrss`` after the step minus its resident memory (``VmRSS``) before it;
the estimate is :func:`gradtrace.capture.memory.estimate_step_memory` (what ``gradtrace collect`` prints as
``memory`` in its plan: activations + logits + backward + rows, beside the weights). Usage::

    python bench/collect_memory.py            # the cases below, a markdown table
    python bench/collect_memory.py --json     # one JSON object per case

``tests/cli/test_cli_polish.py::test_the_plan_memory_estimate_matches_a_measured_peak`` runs the first case (the
shape of the command-line tests' GPT-2).

Measured (x86_64 CPU, 2 cores, python 3.11.7, torch 2.13.0+cpu, transformers 5.24, float32, LoGra rank 4, one
thread; random-init models, SDPA attention unless eager):

| model | batch x length | estimate (activations + logits + backward + rows) | measured peak | estimate / measured |
|---|---|---|---|---|
| gpt2 h=32 L=2 V=320 | 256 x 48 | 183.2 MiB (90.0 + 45.0 + 48.0 + 0.23) | 175.6 MiB | 1.04 |
| gpt2 h=64 L=2 V=320 | 128 x 64 | 214.1 MiB (120.0 + 30.0 + 64.0 + 0.11) | 214.2 MiB | 1.00 |
| gpt2 h=64 L=2 V=320 | 256 x 64 | 428.2 MiB (240.0 + 60.0 + 128.0 + 0.23) | 429.7 MiB | 1.00 |
| gpt2 h=128 L=4 V=2000 | 64 x 128 | 779.6 MiB (464.0 + 187.5 + 128.0 + 0.10) | 804.7 MiB | 0.97 |
| gpt2-eager h=64 L=2 V=320 | 64 x 256 | 492.1 MiB (304.0 + 60.0 + 128.0 + 0.06) | 487.3 MiB | 1.01 |
| llama h=64 L=2 V=320 | 256 x 64 | 343.3 MiB (195.0 + 60.0 + 88.0 + 0.27) | 388.5 MiB | 0.88 |

The logits and backward coefficients were fitted to these rows (the activations' to autograd's saved tensors), so
they are a calibration on these shapes, not an independent check.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

CASES = [
    {"arch": "gpt2", "hidden": 32, "layers": 2, "vocab": 320, "batch": 256, "length": 48},  # the CLI tests' model
    {"arch": "gpt2", "hidden": 64, "layers": 2, "vocab": 320, "batch": 128, "length": 64},
    {"arch": "gpt2", "hidden": 64, "layers": 2, "vocab": 320, "batch": 256, "length": 64},
    {"arch": "gpt2", "hidden": 128, "layers": 4, "vocab": 2000, "batch": 64, "length": 128},
    {"arch": "gpt2-eager", "hidden": 64, "layers": 2, "vocab": 320, "batch": 64, "length": 256},
    {"arch": "llama", "hidden": 64, "layers": 2, "vocab": 320, "batch": 256, "length": 64},
]

CHILD = """
import gc, json, resource, sys
import torch
import gradtrace
from gradtrace.capture.memory import estimate_step_memory

case = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
h, n, v, b, t = case["hidden"], case["layers"], case["vocab"], case["batch"], case["length"]
if case["arch"].startswith("gpt2"):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=v, n_positions=t, n_embd=h, n_layer=n, n_head=2, bos_token_id=0, eos_token_id=0)
    if case["arch"] == "gpt2-eager":
        config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=int(2.75 * h),
                                         num_hidden_layers=n, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=t, bos_token_id=0, eos_token_id=0))
projection = gradtrace.LoGra(rank=4)
batch = lambda rows: {"input_ids": torch.randint(1, v, (rows, t)),
                      "attention_mask": torch.ones(rows, t, dtype=torch.long)}
warm = gradtrace.collect(model, [batch(1)], options=gradtrace.CaptureOptions(projection=projection))
dim = warm.dim
del warm
data = [batch(b)]
gc.collect()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before, peak_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
gradtrace.collect(model, data, options=gradtrace.CaptureOptions(projection=projection))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
estimate = estimate_step_memory(model, b, t, dim)
print(json.dumps({**case, "measured": peak - before, "peak_before_step_over_rss": peak_before - before,
                  "estimate": estimate.total, "activations": estimate.activations, "logits": estimate.logits,
                  "backward": estimate.backward, "rows": estimate.rows, "weights": estimate.weights,
                  "torch": torch.__version__}))
"""


def measure(case: dict) -> dict:
    """One case in a fresh process: ``{..., "measured": bytes, "estimate": bytes, ...}``."""
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = parser.parse_args()
    rows = [measure(case) for case in CASES]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    mib = 2 ** 20
    print(f"# {platform.machine()} CPU, python {platform.python_version()}, torch {rows[0]['torch']}, float32, "
          "LoGra rank 4, one thread")
    print("| model | batch x length | estimate (activations + logits + backward + rows) | measured peak | "
          "estimate / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        shape = f"{r['arch']} h={r['hidden']} L={r['layers']} V={r['vocab']}"
        print(f"| {shape} | {r['batch']} x {r['length']} | {r['estimate'] / mib:.1f} MiB ({r['activations'] / mib:.1f}"
              f" + {r['logits'] / mib:.1f} + {r['backward'] / mib:.1f} + {r['rows'] / mib:.2f}) | "
              f"{r['measured'] / mib:.1f} MiB | {r['estimate'] / r['measured']:.2f} |")


if __name__ == "__main__":
    main()
