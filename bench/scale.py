"""Scale on one machine: collection cost, peak memory and store size for a 20M-parameter GPT-2 (issue #17).

The setup (fixed before any run): a random-init GPT-2 of 6 layers x 512 (8 heads, GPT-2's 50,257-token
vocabulary, 20.1M parameters + the tied 25.7M-entry embedding), ``--examples`` random-token examples of 256
tokens in batches of 8, an int8 store with LoGra rank 16 and 64. Each mode runs in a process of its own (peak
RSS is the process's ``ru_maxrss``):

* ``train``     -- a plain training step (forward + backward + AdamW) on every batch, the cost to compare with;
* ``collect16`` -- ``gradtrace.collect(..., projection=LoGra(rank=16), store=..., dtype="int8")``;
* ``collect64`` -- the same at rank 64.

Peak RSS is reported for the whole process and, for a collect mode, also as it stood when the collection ended
(``peak_rss_collect_mib``; a reporting detail added after the first 8,000-example run, the setup is unchanged).
A collect mode then scores 50 query examples (collected in memory with the same projection) against its store
with ``grad_dot`` top-10 and reports the time: the streaming cost every method pays (influence methods add a
preconditioning of the 50 query rows). Reported per mode: seconds per example (whole run / examples, the
store writer and its int8 conversion included), the ratio to ``train``, peak RSS, store bytes per example.
Issue #17's targets: collect at rank 16 <= 0.8x and rank 64 <= 1.0x a training step; peak RSS <= the training
step's peak + 25%, the same at 2,000 and 8,000 examples.

    python bench/scale.py                          # 2,000 examples, every mode
    python bench/scale.py --examples 8000 --modes collect64
    python bench/scale.py --examples 200           # a quick look (not the issue's setup)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradtrace.options import CaptureOptions, StoreOptions

MODES = ("train", "collect16", "collect64")
SEQ, BATCH, VOCAB, QUERIES = 256, 8, 50257, 50


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _batches(n: int, seed: int, prefix: str):
    """Random-token batches, generated lazily (the data itself must not hold memory that grows with n)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, BATCH):
        size = min(BATCH, n - start)
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
        yield {"input_ids": ids, "id": [f"{prefix}{j}" for j in range(start, start + size)]}


def run_mode(args: argparse.Namespace) -> dict:
    import torch

    import gradtrace

    torch.set_num_threads(args.threads)
    model = _model()
    result: dict = {"mode": args.mode, "examples": args.examples}
    start = time.perf_counter()
    if args.mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for batch in _batches(args.examples, 1, "t"):
            model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        result["seconds"] = time.perf_counter() - start
    else:
        rank = int(args.mode.removeprefix("collect"))
        logra = gradtrace.LoGra(rank=rank)
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            store = gradtrace.collect(model, _batches(args.examples, 1, "t"), store=Path(tmp) / "store",
                                      options=CaptureOptions(projection=logra),
                                      store_options=StoreOptions(dtype="int8"))
            result["seconds"] = time.perf_counter() - start
            result["peak_rss_collect_mib"] = _peak_rss_mib()  # the collection's peak, before the scoring's
            size = sum(f.stat().st_size for f in (Path(tmp) / "store").rglob("*") if f.is_file())
            result.update(dim=store.dim, store_bytes_per_example=size / len(store), rows=len(store))
            t = time.perf_counter()
            queries = gradtrace.collect(model, _batches(QUERIES, 2, "q"), options=CaptureOptions(projection=logra))
            result["query_collect_seconds"] = time.perf_counter() - t
            t = time.perf_counter()
            gradtrace.Attributor("grad_dot", store).score(queries, topk=10)
            result["score_seconds"] = time.perf_counter() - t
    result["seconds_per_example"] = result["seconds"] / args.examples
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def _peak_rss_mib() -> float:
    """This process's peak resident memory so far (``ru_maxrss``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tmp", default=None, help="where the store is written (default: the system's temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode, "--examples", str(args.examples), "--threads",
               str(args.threads)] + (["--tmp", args.tmp] if args.tmp else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(results[mode]), flush=True)
    train = results.get("train")
    print(f"\n{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads, {args.examples} examples x {SEQ} "
          f"tokens, batch {BATCH}\n")
    print("| mode | s/example | x train | peak RSS (MiB) | x train peak | collection peak (MiB) | store B/example | "
          "score 50 queries (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['seconds_per_example'] / train['seconds_per_example']:.2f}" if train else "-"
        peak = f"{r['peak_rss_mib'] / train['peak_rss_mib']:.2f}" if train else "-"
        size = f"{r['store_bytes_per_example']:,.0f}" if "store_bytes_per_example" in r else "-"
        score = f"{r['score_seconds']:.2f}" if "score_seconds" in r else "-"
        collect = f"{r['peak_rss_collect_mib']:,.0f}" if "peak_rss_collect_mib" in r else "-"
        print(f"| {mode} | {r['seconds_per_example']:.3f} | {ratio} | {r['peak_rss_mib']:,.0f} | {peak} | {collect} | "
              f"{size} | {score} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
