"""Per-example gradients from a plain PyTorch training loop: gradient accumulation and bf16 autocast.

``gradtrace.capture`` wraps the loop unchanged. The loop's loss is Hugging Face's token mean of each
micro-batch divided by the accumulation steps, so the capture is told
``Loss(reduction="token_mean", scale=1/accumulation)``: every stored gradient is then the gradient of one
document's own summed token loss, whatever the batch it came in. The gradients of the last epoch go to a store,
and questions paraphrasing the planted facts are scored against it.

    .venv/bin/python examples/plain_loop.py [--docs 64] [--epochs 3] [--bf16]
"""

from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import gradtrace
from gradtrace.data.corpus import PLANTED, load_plays, train_tokenizer
from gradtrace.demo.report import report_planted
from gradtrace.options import CaptureOptions, Loss, StoreOptions


def main(out_dir: str | Path = "runs/plain_loop", *, docs: int = 64, epochs: int = 3, batch_size: int = 8,
         accumulation: int = 2, width: int = 64, rank: int = 16, bf16: bool = False, seed: int = 0,
         verbose: bool = True) -> dict[str, Any]:
    say = print if verbose else (lambda *a, **k: None)
    transformers.utils.logging.set_verbosity_error()
    started = time.perf_counter()
    torch.manual_seed(seed)
    out = Path(out_dir)
    corpus = [(d.id, d.text) for d in load_plays(docs, seed=seed)] + [(p.id, p.text) for p in PLANTED]
    tokenizer = train_tokenizer([text for _, text in corpus], vocab_size=1024)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=width, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, loss_type="ForCausalLM"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch_of(rows: list[tuple[str, str]]) -> dict:
        enc = tokenizer([text for _, text in rows], padding=True, truncation=True, max_length=64, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return {"id": [i for i, _ in rows], "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": labels}

    logra = gradtrace.LoGra(rank=rank, seed=seed)
    rng = random.Random(seed)
    model.train()
    for epoch in range(epochs):
        order = rng.sample(corpus, len(corpus))
        last = epoch == epochs - 1
        writer = gradtrace.StoreWriter(out / "store", StoreOptions(dtype="int8", overwrite=True)) if last else None
        capture = (gradtrace.capture(model, Loss(reduction="token_mean", scale=1 / accumulation),
                                     options=CaptureOptions(projection=logra), callbacks=[writer])
                   if last else nullcontext())
        total, count = 0.0, 0
        with capture as cap:
            for start in range(0, len(order), batch_size):
                batch = batch_of(order[start:start + batch_size])
                ids = batch.pop("id")
                if cap is not None:
                    cap.annotate(ids=ids)  # the documents' own ids instead of content hashes
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(**batch).loss  # token mean of this micro-batch
                (loss / accumulation).backward()
                if (start // batch_size + 1) % accumulation == 0 or start + batch_size >= len(order):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                total, count = total + loss.item(), count + 1
        say(f"epoch {epoch + 1}/{epochs}: mean loss {total / count:.3f}" + ("  (captured)" if last else ""))
        if last:
            report = cap.report()
    store = gradtrace.GradientStore.open(out / "store")
    say(str(report).splitlines()[0])

    questions = [(f"query-{p.id.removeprefix('planted-')}", p.query) for p in PLANTED]
    queries = gradtrace.collect(model, [batch_of(questions)], options=CaptureOptions(projection=logra))
    scores = gradtrace.Attributor("grad_cos", store).score(queries, topk=3)
    hits = report_planted(scores, dict(corpus), say, show=2)
    seconds = time.perf_counter() - started
    say(f"\nstore: {len(store)} documents x {store.dim} dims ({store.spec.dtype}); recall@1: {hits}/{len(questions)}; "
        f"time {seconds:.1f} s")
    return {"store": store, "scores": scores, "recall_at_1": hits / len(questions), "seconds": seconds,
            "model": model, "report": report}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/plain_loop")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    opts = parser.parse_args()
    main(opts.out, docs=opts.docs, epochs=opts.epochs, bf16=opts.bf16)
