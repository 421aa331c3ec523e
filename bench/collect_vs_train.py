"""LoGra collection against a plain training pass, side by side in one process (issue #30, item 7).

Workload W1: a random-init GPT-2 (4 layers, width 256, GPT-2's 50,257-token vocabulary), uniform random token ids,
batch 16, fp32 on the CPU; 256 sequences of 128 tokens and 64 of 512. ``train`` is one forward + backward pass with
the model's own loss (parameter gradients computed, no optimizer); ``collect`` is ``gradtrace.collect`` with
``LoGra(rank=8)`` into a store (no weight-gradient products). The two take turns for ``--rounds`` rounds (machine
drift hits both) and the best round of each is kept. The ratio's floor is about 2/3: forward plus the input-gradient
half of the backward. ``--profile`` adds where the collection's time goes (torch.profiler, by operator). Usage::

    python bench/collect_vs_train.py [--seqs 128,512] [--rounds 3] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch


def workload(seq: int) -> tuple[torch.nn.Module, list[dict]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=seq, vocab_size=50257,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    count = 256 if seq <= 128 else 64
    tokens = torch.randint(0, 50257, (count, seq), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": tokens[i:i + 16], "id": [f"t{j}" for j in range(i, i + 16)]}
                   for i in range(0, count, 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import transformers

    import gradtrace
    from gradtrace.options import CaptureOptions

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    options = CaptureOptions(projection=gradtrace.LoGra(rank=8))
    print(f"# {platform.machine()} {args.threads} threads, torch {torch.__version__}; GPT-2 4x256, vocab 50257, "
          f"batch 16, fp32; best of {args.rounds} alternating rounds")
    print(f"{'tokens':>6} {'examples':>8} {'train s':>8} {'collect s':>9} {'ratio':>6}")
    for seq in (int(s) for s in args.seqs.split(",")):
        measure(seq, args.rounds, args.profile, options)


def measure(seq: int, rounds: int, profiled: bool, options) -> None:
    """One row of the table: the best of ``rounds`` alternating rounds of ``train`` and ``collect`` at ``seq``."""
    import gradtrace
    from gradtrace.options import StoreOptions

    model, batches = workload(seq)

    def train() -> None:
        for batch in batches:
            model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        model.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory() as root:
        def collect() -> None:
            gradtrace.collect(model, batches, store=f"{root}/s", options=options,
                              store_options=StoreOptions(overwrite=True))

        train()
        collect()  # warm-up of both
        best = {"train": float("inf"), "collect": float("inf")}
        for _ in range(rounds):
            for name, fn in (("train", train), ("collect", collect)):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{seq:>6} {len(batches) * 16:>8} {best['train']:>8.2f} {best['collect']:>9.2f} "
              f"{best['collect'] / best['train']:>6.3f}")
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                collect()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

if __name__ == "__main__":
    main()
