"""A fine-tune trained far past convergence: single final-model methods against the checkpoints, and the diagnostics.

Setup, fixed before any result was seen (issue #29, item 3):

* data: the demo's corpus (``--docs`` Shakespeare documents) plus its 8 planted facts; the 8 queries paraphrase the
  planted facts (no sentence in common), as in ``gradtrace demo``;
* model: a random-init GPT-2, 2 layers, width 128, the demo's locally trained byte-level BPE tokenizer;
* training: AdamW (lr 3e-3, no weight decay, linear decay), batch 16, ``--epochs`` epochs (default 40, five times
  the demo's 8), the weights kept at epochs 2, 5, 10, 20, 30 and 40 (the run's checkpoints);
* attribution: LoGra rank 64 (seed 0) gradients of every training document and query at each kept checkpoint;
  recall@1 = queries whose own planted document ranks first, out of 8;
* single-model methods at the final weights: ``grad_dot``, ``grad_cos``; at the demo's epoch (the healthy case):
  ``grad_cos`` at epoch 10; the default workflow: the ``grad_cos`` ensemble of the last 4 checkpoints
  (``Ensemble("grad_cos", ...)``, what ``gradtrace collect --checkpoints-of RUN --last 4`` then ``score`` runs),
  and of all 6;
* diagnostics (:mod:`gradtrace.score.diagnostics`) of each single-model scoring: the gradient ratio and the share
  of queries whose top-1 is within noise; whether the memorisation warning fires.

Seeds 0, 1, 2 (``--seeds``); seed 0 set the diagnostics' thresholds, 1 and 2 check them. Usage::

    python bench/converged_sft.py                  # 3 seeds, 40 epochs (~10 min on 2 CPU cores)
    python bench/converged_sft.py --seeds 0 --epochs 20 --docs 200
    python bench/converged_sft.py --seeds 0 --save runs/converged   # then: gradtrace attribute runs/converged/...
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from gradtrace.options import CaptureOptions

KEEP = (2, 5, 10, 20, 30, 40)


def run(seed: int, epochs: int, docs: int, rank: int = 64, width: int = 128, batch_size: int = 16,
        max_length: int = 96, lr: float = 3e-3, save: str | None = None) -> dict:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradtrace
    import gradtrace.data as gd
    from gradtrace.data.corpus import PLANTED, Document, load_plays, train_tokenizer
    from gradtrace.loss import lm_labels
    from gradtrace.options.data import BatchOptions, ReadOptions
    from gradtrace.score.diagnostics import diagnose

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)
    corpus = load_plays(docs, seed=seed) + [Document(p.id, p.text) for p in PLANTED]
    tokenizer = train_tokenizer([d.text for d in corpus])
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=max_length, n_embd=width, n_layer=2,
                        n_head=max(1, width // 32), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    read = ReadOptions(max_length=max_length, truncate=True)
    train = gd.load([{"id": d.id, "text": d.text} for d in corpus], tokenizer, read_options=read,
                    batch_options=BatchOptions(batch_size=batch_size))
    queries = gd.load([{"id": f"query-{p.id}", "text": p.query} for p in PLANTED], tokenizer, read_options=read,
                      batch_options=BatchOptions(batch_size=len(PLANTED)), what="queries")
    if save is not None:  # the data as gradtrace attribute reads it
        Path(save).mkdir(parents=True, exist_ok=True)
        with open(Path(save) / "train.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in corpus)
        with open(Path(save) / "queries.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": f"query-{p.id}", "text": p.query}) + "\n" for p in PLANTED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((len(corpus) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (steps + 1))
    keep = [e for e in KEEP if e <= epochs]
    kept: dict[int, dict] = {}
    losses: dict[int, float] = {}
    rng = random.Random(seed)
    started = time.perf_counter()
    model.train()
    for epoch in range(1, epochs + 1):
        order = list(range(len(corpus)))
        rng.shuffle(order)
        total, count = 0.0, 0
        for batch in train.batches(order):
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=lm_labels(batch)).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            total, count = total + loss.item(), count + 1
        if epoch in keep:
            kept[epoch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            losses[epoch] = total / count
            if save is not None:  # as a Trainer run directory: checkpoint-<step>, with the tokenizer
                target = Path(save) / "run" / f"checkpoint-{epoch * ((len(corpus) + batch_size - 1) // batch_size)}"
                model.save_pretrained(target)
                tokenizer.save_pretrained(target)
    train_s = time.perf_counter() - started
    projection = gradtrace.LoGra(rank=rank, seed=0)
    truth = [p.id for p in PLANTED]
    grads = {}
    for epoch, state in kept.items():
        model.load_state_dict(state)
        model.eval()
        grads[epoch] = (gradtrace.collect(model, train, options=CaptureOptions(projection=projection)),
                        gradtrace.collect(model, queries, options=CaptureOptions(projection=projection)))

    def recall(scores) -> int:
        top = scores.topk(1)
        return sum(top.ids[q][0] == truth[q] for q in range(len(truth)))

    def single(method: str, epoch: int) -> dict:
        tr, qu = grads[epoch]
        scores = gradtrace.Attributor(method, tr).score(qu, topk=10)
        found = diagnose(scores, train=tr, queries=qu, label=f"epoch {epoch}")
        return {"recall@1": recall(scores), "gradient_ratio": found.gradient_ratio[0],
                "flat": len(found.flat), "warned_memorised": any("memorised" in w for w in found.warnings),
                "warned_flat": any("stands out" in w for w in found.warnings)}

    def ensemble(epochs_: list[int]) -> dict:
        scores = gradtrace.Ensemble("grad_cos", [grads[e][0] for e in epochs_]).score(
            [grads[e][1] for e in epochs_], topk=10)
        return {"recall@1": recall(scores), "members": epochs_}

    final = keep[-1]
    out = {"seed": seed, "epochs": epochs, "docs": len(corpus), "train_s": round(train_s, 1),
           "mean_loss": {e: round(v, 4) for e, v in losses.items()},
           "final grad_dot": single("grad_dot", final), "final grad_cos": single("grad_cos", final)}
    for epoch in keep[:-1]:
        out[f"epoch {epoch} grad_cos"] = single("grad_cos", epoch)
    out["ensemble last 4"] = ensemble(keep[-4:])
    out["ensemble all"] = ensemble(keep)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--save", help="also save each seed's run as DIR/seed-S/run/checkpoint-N (+ train.jsonl, "
                        "queries.jsonl): the input of gradtrace attribute")
    args = parser.parse_args()
    for seed in args.seeds:
        save = None if args.save is None else str(Path(args.save) / f"seed-{seed}")
        print(json.dumps(run(seed, args.epochs, args.docs, save=save)), flush=True)


if __name__ == "__main__":
    main()
