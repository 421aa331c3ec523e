"""End to end: collect training gradients, then score queries against them, beside a plain training pass.

Workload (as in the issue): a random-init GPT-2 (4 layers, width 256, GPT-2's 50,257-token vocabulary),
256 training and 16 query sequences of 128 tokens (uniform random token ids), batch 16, fp32.

* ``train``   -- the reference: one forward + backward pass over the 256 training sequences (no optimizer).
* ``logra8`` / ``logra32`` -- ``gradtrace.collect`` of the training set into a gradient store (LoGra rank 8 /
  32; no weight gradients are computed), ``collect`` of the queries, ``Attributor("grad_dot").score``.
* ``exact``   -- no projection: the training gradients cannot be stored (16M numbers per example), so each
  captured training batch is scored against the query batch by ghost (factorized) inner products as it is
  produced (``gradtrace.grad.ops.inner``), with the weight-gradient work skipped as in ``collect``.
* ``sft_tok`` / ``sft_parquet`` -- real data in: ``--train`` prompt/completion pairs (cut to ``--seq`` tokens
  from the left of the prompt; the completion is about a fifth of them) collected with LoGra rank 8 into a
  store, completion-only loss. ``sft_tok`` times ``collect`` of the examples already tokenized;
  ``sft_parquet`` times ``gradtrace.data.load`` of the Parquet file (read in record batches, tokenized,
  masked, hashed) plus the same ``collect``. The tokenizer is a byte-level BPE trained locally (2,048
  tokens; the model keeps its 50,257-row vocabulary).

Each mode runs in its own process (peak resident memory is that mode's own), twice, alternating; the faster
run is reported. Usage: ``python bench/end_to_end.py [--train 256 --queries 16 --seq 128] [--modes a,b]``.
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

from gradtrace.options import CaptureOptions, Loss

MODES = ("train", "exact", "logra8", "logra32", "sft_tok", "sft_parquet")
WORDS = ("the", "king", "queen", "night", "day", "love", "war", "sword", "crown", "heart", "speak", "hear", "come",
         "go", "fair", "foul", "sweet", "bitter", "lord", "lady", "death", "life", "hand", "eye", "blood", "tears")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_mode(args: argparse.Namespace) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradtrace
    from gradtrace.grad.ops import inner

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=args.seq, vocab_size=args.vocab,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, args.vocab, (args.train, args.seq), generator=gen)
    queries = torch.randint(0, args.vocab, (args.queries, args.seq), generator=gen)
    batches = [{"input_ids": train[i:i + args.batch], "id": [f"t{j}" for j in range(i, i + args.batch)]}
               for i in range(0, args.train, args.batch)]
    qbatches = [{"input_ids": queries, "id": [f"q{j}" for j in range(args.queries)]}]
    if args.mode.startswith("sft"):
        return _sft_mode(args, model)
    base = _rss_mb()
    start = time.perf_counter()
    if args.mode == "train":
        model.train()
        for b in batches:
            model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()
        result = {}
    elif args.mode == "exact":
        model.eval()
        with gradtrace.capture(model, loss=Loss(reduction="sum")) as qcap:
            qcap.annotate(ids=qbatches[0]["id"])
            out = gradtrace.loss.functions.causal_lm_loss(model, qbatches[0])
            torch.autograd.grad(out.sum(), [p for p in model.parameters()])
        query_batch = qcap.batches[0]
        columns = []
        cap = gradtrace.capture(model, loss=Loss(reduction="sum"),
                                callbacks=[lambda b: columns.append(inner(query_batch, b))])
        cap.track_outputs = True
        with cap:
            for b in batches:
                cap.annotate(ids=b["id"])
                loss = gradtrace.loss.functions.causal_lm_loss(model, b).sum()
                torch.autograd.grad(loss, cap.pop_outputs())
        result = {"scores": list(torch.cat(columns, 1).shape)}
    else:
        rank = {"logra8": 8, "logra32": 32}[args.mode]
        with tempfile.TemporaryDirectory() as tmp:
            store = gradtrace.collect(model, batches, store=f"{tmp}/store",
                                      options=CaptureOptions(projection=gradtrace.LoGra(rank=rank)))
            q = gradtrace.collect(model, qbatches, options=CaptureOptions(projection=gradtrace.LoGra(rank=rank)))
            scores = gradtrace.Attributor("grad_dot", store).score(q, topk=10)
            result = {"scores": list(scores.matrix.shape), "dim": store.dim}
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "seconds": seconds, "peak_over_start_mb": peak - base, **result}


def _sft_mode(args: argparse.Namespace, model) -> dict:
    """Collect prompt/completion pairs from a Parquet file, with or without the data preparation timed."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    import gradtrace
    import gradtrace.data as gd
    from gradtrace.data.corpus import train_tokenizer
    from gradtrace.options.data import BatchOptions, ReadOptions

    rng = random.Random(0)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    words = max(4, args.seq)  # more tokens than --seq: prompts are cut from the left to --seq tokens
    records = [{"id": f"t{i}", "prompt": sentence(words * 3 // 4) + "?", "completion": " " + sentence(words // 4)}
               for i in range(args.train)]
    tok = train_tokenizer([r["prompt"] + r["completion"] for r in records[:64]])
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/sft.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
        pretokenized = None
        read, batching = ReadOptions(max_length=args.seq), BatchOptions(batch_size=args.batch)
        if args.mode == "sft_tok":  # prepared before the clock starts
            pretokenized = gd.load(path, tok, read_options=read, batch_options=batching)
        base = _rss_mb()
        start = time.perf_counter()
        data = pretokenized if pretokenized is not None else gd.load(path, tok, read_options=read,
                                                                     batch_options=batching)
        prepared = time.perf_counter() - start
        store = gradtrace.collect(model, data, store=f"{tmp}/store",
                                  options=CaptureOptions(projection=gradtrace.LoGra(rank=8)))
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "seconds": seconds, "peak_over_start_mb": peak - base, "dim": store.dim,
            "prepare_s": prepared, "summary": data.summary.line()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (default: all)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = [m for m in MODES if m in args.modes.split(",")]
    if "train" not in modes:
        modes.insert(0, "train")  # the reference of every ratio
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode in modes:
            cmd = [sys.executable, __file__, "--mode", mode, "--train", str(args.train), "--queries",
                   str(args.queries), "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {m: min(r, key=lambda x: x["seconds"]) for m, r in results.items()}
    peak = {m: min(x["peak_over_start_mb"] for x in r) for m, r in results.items()}
    print(f"# {platform.machine()} {os.cpu_count()} cpus, {args.threads} threads, python {platform.python_version()}; "
          f"GPT-2 4x256, vocab {args.vocab}, {args.train} train + {args.queries} query sequences of {args.seq} "
          f"tokens, batch {args.batch}, fp32; best of {args.reps} runs per mode, each in its own process")
    print(f"{'mode':<12}{'seconds':>9}{'vs train':>10}{'peak MB':>9}{'vs train':>10}  notes")
    for mode in modes:
        r = best[mode]
        note = f"store dim {r['dim']}" if "dim" in r else ("ghost inner products, nothing stored"
                                                           if mode == "exact" else "forward + backward")
        if mode == "sft_parquet":
            note += f"; data prepared in {r['prepare_s']:.2f} s"
        print(f"{mode:<12}{r['seconds']:>9.2f}{r['seconds'] / best['train']['seconds']:>10.2f}{peak[mode]:>9.0f}"
              f"{peak[mode] / peak['train']:>10.2f}  {note}")
    if "sft_tok" in best and "sft_parquet" in best:
        tok, parquet = best["sft_tok"], best["sft_parquet"]
        print(f"# {parquet['summary']}")
        print(f"# data preparation (read Parquet, tokenize, mask, hash): {parquet['prepare_s']:.2f} s = "
              f"{parquet['prepare_s'] / tok['seconds']:.1%} of collecting the pre-tokenized examples "
              f"({tok['seconds']:.2f} s); sft_parquet / sft_tok = {parquet['seconds'] / tok['seconds']:.3f}")


if __name__ == "__main__":
    main()
