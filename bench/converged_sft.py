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

Seeds 0, 1, 2 (``--seeds``); seed 0 set the diagnostics' thresholds, 1 and 2 check them.

Variant ``--metagrad`` (declared 2026-12-03 before any of its results; issue #32):

* the same setup (data, tokenizer, model size, AdamW lr 3e-3 no weight decay, linear decay, batch 16, epochs, seed
  0 only by default -- metagradients cost many times the run), except that the model uses eager attention
  (``attn_implementation="eager"``: the CPU SDPA kernel has no double backward) for the whole run and every row,
  so the rows compare like for like;
* the training loop is recorded with :class:`gradtrace.replay.RunRecorder`, with the reduction that matches the
  HF GPT-2 loss on the batch (the mean over the batch's shifted label tokens: ``Reduction("token_mean")``, the
  loss returning each document's summed token loss and its count of shifted labels); the replay must reproduce
  the recorded final weights bit for bit or within the replay's default bound, and the difference is printed; a
  run that fails the check is reported, not scored;
* rows: all the rows above (final ``grad_dot``, ``grad_cos``; epoch-k ``grad_cos``; ensembles last 4 / all),
  recomputed on this eager run, plus ``metagradients``: :func:`gradtrace.replay.metagradients` of each of the 8
  queries' summed token loss through the whole recorded run w.r.t. every training document's weight (all queries
  vectorised, default options), scores positive = helps; recall@1 of each row out of 8, as above;
* also printed: training seconds, metagradient seconds and their ratio, the replay difference, and the
  metasmoothness check (:func:`gradtrace.replay.metasmoothness`, default scales, on the 8 queries).
* also printed (added 2026-12-03, before the float64 variant below was run): the growth of the reverse pass
  (``MetaGradients.growth``: per checkpoint segment, the step and the norm of the parameters' cotangent, the largest
  over the queries), and on an overflow the :class:`gradtrace.replay.ReplayError` text (which states the growth per
  step and how far float64 would reach at that rate) with the trace up to the overflow.

Variant ``--metagrad --metagrad-dtype float64`` (declared 2026-12-03 before any of its results; issue #32):

* the ``--metagrad`` variant unchanged up to the end of training (the run trained and recorded in float32), then the
  recorded run (initial and final weights, the manifest's dtypes) and the model cast to float64 in memory, as
  ``gradtrace metagrad --dtype float64`` does, the replay check's bound that of the coarsest precision involved
  (float32's, ``DEFAULT_TOLERANCE[torch.float32]``), the token losses kept in float64; the same rows, the growth
  trace and the metasmoothness check in float64. The question: does float64 reach the start of the run where
  float32 overflows, and are the metagradients' recall@1 then better than the single-model rows'.
* amended 2026-12-03, after a 2-epoch, 20-document smoke test of this code showed the float64 replay of the float32
  run 6.4e-5 away (relative) after 4 steps, before any result of the 40-epoch run: if the replay check refuses the
  float64 replay, that is this variant's result; a second run with ``--metagrad-tolerance 1e30`` (the check
  disabled, the difference printed) then gives the float64 growth trace and rows, reported as metagradients of the
  float64 replay -- a different trajectory from the recorded run, not the recorded run's.

Variant ``--metagrad --metagrad-last 0.1,0.5`` (declared 2026-12-03 before any of its results; issue #32):

* the ``--metagrad`` variant (float32, seed 0) unchanged up to the end of training and its rows, then, instead of
  the whole-run pass (its result, recall@1 0 of 8 with a cotangent grown x1.048 per step, is in
  docs/metagradients.md), for each share ``s``: truncated metagradients (``MetagradOptions(start_step=T -
  round(s * T))``, the last ``round(s * T)`` of the ``T = 1,040`` steps; all 8 queries vectorised, default spacing),
  row ``metagradients, last s``: recall@1 out of 8, the planted documents' ranks, seconds and their ratio to the
  training run, the growth trace, and the metasmoothness check of its own function (default scales, the weights
  perturbed from its ``start_step`` on). The question: does leaving out the early, amplifying steps give
  metagradients that find the planted documents where the single-model rows do not.

Variant ``--metagrad --metagrad-last 0.1 --metagrad-keep-states 104`` (declared 2026-12-03 before any of its
results; issue #32): the ``--metagrad-last`` variant with the run recorded by ``RunRecorder(...,
keep_states=104)`` (the optimizer state before every 104th step: 10% of the 1,040), so that the truncated pass over
the last 10% (``start_step`` 936 = 9 x 104) replays from the state recorded before step 936 instead of from the
first step; the same rows. The question: its seconds against the 245 s (3.5x the training run) of the pass that
replays all 1,040 steps -- the scores must be the same.

Usage::

    python bench/converged_sft.py                  # 3 seeds, 40 epochs (~10 min on 2 CPU cores)
    python bench/converged_sft.py --seeds 0 --epochs 20 --docs 200
    python bench/converged_sft.py --seeds 0 --save runs/converged   # then: gradtrace attribute runs/converged/...
    python bench/converged_sft.py --metagrad --seeds 0               # eager attention, + metagradients
    python bench/converged_sft.py --metagrad --metagrad-dtype float64 --keep-run /tmp/run   # reverse in float64
    python bench/converged_sft.py --metagrad --metagrad-last 0.1,0.5   # truncated passes over the last 10%, 50%
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from gradtrace.options import CaptureOptions

KEEP = (2, 5, 10, 20, 30, 40)


def token_losses(forward, batch: dict):
    """Each row's summed next-token loss and its count of shifted labels: ``Reduction("token_mean")`` of these is
    the HF GPT-2 loss of the batch (the mean over its shifted label tokens), the same ops as ``ForCausalLMLoss``."""
    import torch
    import torch.nn.functional as F

    from gradtrace.loss import lm_labels

    logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float64 stays (--metagrad-dtype)
    shifted = F.pad(lm_labels(batch), (0, 1), value=-100)[:, 1:]  # [B, T]: labels[t + 1], as HF shifts them
    per_token = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100,
                                reduction="none").view(shifted.shape)
    return per_token.sum(1), (shifted != -100).sum(1)


def replay_inputs(train, queries):
    """``batches(ids)`` of the training documents, one batch per query, and a query's loss (its summed token loss):
    the inputs of the metagradients."""
    import numpy as np

    index = {ident: i for i, ident in enumerate(train.ids)}

    def batches(ids: list) -> dict:
        return train.rows(np.asarray([index[i] for i in ids], dtype=np.int64))

    def query_loss(forward, batch: dict):
        return token_losses(forward, batch)[0].sum()

    return batches, [queries.rows(np.asarray([q], dtype=np.int64)) for q in range(queries.num_examples)], query_loss


def truncated_rows(run_dir: Path, model, train, queries, truth: list[str], train_s: float,
                   shares: list[float]) -> dict:
    """The ``--metagrad-last`` rows: per share, truncated metagradients of the 8 queries over the last steps, their
    recall@1, the growth of the pass and the metasmoothness check of the truncated function."""

    from gradtrace.options import MetagradOptions
    from gradtrace.replay import load_run, metagradients, metasmoothness
    from gradtrace.replay.growth import growth_rate

    recorded = load_run(run_dir)
    batches, query_batches, query_loss = replay_inputs(train, queries)

    total, out = len(recorded.steps), {}
    for share in shares:
        start = total - round(share * total)
        started = time.perf_counter()
        result = metagradients(recorded, model, token_losses, batches, query_batches, query_loss,
                               train_ids=list(train.ids), options=MetagradOptions(start_step=start))
        seconds = time.perf_counter() - started
        order = result.scores.argsort(dim=1, descending=True)
        ranks = [int((order[q] == result.ids.index(truth[q])).nonzero()[0, 0]) + 1 for q in range(len(truth))]
        fitted = growth_rate(result.growth)
        started = time.perf_counter()
        smooth = metasmoothness(recorded, model, token_losses, batches, query_batches, query_loss, result=result)
        row = {"start_step": start, "replayed_from": result.replayed_from, "steps": total,
               "replay_difference": result.replay_difference,
               "seconds": round(seconds, 1), "x_training": round(seconds / train_s, 2),
               "recall@1": sum(r == 1 for r in ranks), "planted_ranks": ranks,
               "growth_per_step": None if fitted is None else fitted[-1],
               "growth": [[s, f"{n:.4g}"] for s, n in result.growth],
               "nonfinite_scores": int((~result.scores.isfinite()).sum()),
               "metasmoothness": {"scales": smooth.scales, "relative_error": smooth.relative_error,
                                  "sign_agreement": smooth.sign_agreement,
                                  "seconds": round(time.perf_counter() - started, 1)}}
        print(json.dumps({f"metagradients, last {share:g}": row}), flush=True)
        out[f"metagradients, last {share:g}"] = row
    return out


def metagrad_rows(run_dir: Path, model, train, queries, truth: list[str], train_s: float,
                  dtype: str = "float32", tolerance: float | None = None) -> dict:
    """The ``--metagrad`` rows: the replay check, metagradients of the 8 queries, their recall@1, metasmoothness,
    the growth of the reverse pass; in ``dtype`` (the run recorded in float32)."""
    import torch

    from gradtrace.options import MetagradOptions
    from gradtrace.replay import ReplayError, load_run, metagradients, metasmoothness
    from gradtrace.replay.growth import growth_rate
    from gradtrace.replay.replay import DEFAULT_TOLERANCE

    recorded = load_run(run_dir)
    options = None
    if dtype != "float32":
        recorded.cast(getattr(torch, dtype))  # as gradtrace metagrad --dtype does
        model = model.to(getattr(torch, dtype))
        options = MetagradOptions(tolerance=DEFAULT_TOLERANCE[torch.float32])  # the coarsest precision involved
    if tolerance is not None:
        options = MetagradOptions(tolerance=tolerance)
    batches, query_batches, query_loss = replay_inputs(train, queries)

    started = time.perf_counter()
    try:
        result = metagradients(recorded, model, token_losses, batches, query_batches, query_loss,
                               train_ids=list(train.ids), options=options)
    except ReplayError as err:  # reported, not scored
        return {"dtype": dtype, "replay": f"FAILED: {err}", "train_s": round(train_s, 1),
                "failed_after_s": round(time.perf_counter() - started, 1),
                "growth": [[s, f"{n:.4g}"] for s, n in getattr(err, "growth", [])]}
    metagrad_s = time.perf_counter() - started
    print(json.dumps({"growth": [[s, f"{n:.4g}"] for s, n in result.growth]}), flush=True)
    fitted = growth_rate(result.growth)
    order = result.scores.argsort(dim=1, descending=True)  # [Q, N]
    ranks = [int((order[q] == result.ids.index(truth[q])).nonzero()[0, 0]) + 1 for q in range(len(truth))]
    started = time.perf_counter()
    smooth = metasmoothness(recorded, model, token_losses, batches, query_batches, query_loss, result=result)
    smooth_s = time.perf_counter() - started
    print(smooth.table(), flush=True)
    return {"dtype": dtype, "replay_difference": result.replay_difference, "steps": len(recorded.steps),
            "growth_per_step": None if fitted is None else fitted[-1],
            "growth": [[s, f"{n:.4g}"] for s, n in result.growth],
            "checkpoint_every": result.checkpoint_every, "train_s": round(train_s, 1),
            "metagrad_s": round(metagrad_s, 1), "metagrad_x_training": round(metagrad_s / train_s, 1),
            "metagradients": {"recall@1": sum(r == 1 for r in ranks), "planted_ranks": ranks,
                              "nonfinite_scores": int((~result.scores.isfinite()).sum())},  # > 0: ranks meaningless
            "metasmoothness": {"scales": smooth.scales, "relative_error": smooth.relative_error,
                               "sign_agreement": smooth.sign_agreement, "seconds": round(smooth_s, 1)}}


def run(seed: int, epochs: int, docs: int, rank: int = 64, width: int = 128, batch_size: int = 16,
        max_length: int = 96, lr: float = 3e-3, save: str | None = None, metagrad: bool = False,
        metagrad_dtype: str = "float32", keep_run: str | None = None, metagrad_tolerance: float | None = None,
        metagrad_last: list[float] | None = None, keep_states: int | None = None) -> dict:
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
    if metagrad:  # eager attention for the whole run and every row (the CPU SDPA kernel has no double backward)
        config._attn_implementation = "eager"
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
    recorder = None
    if metagrad:
        from gradtrace.replay import Reduction, RunRecorder

        run_dir = Path(tempfile.mkdtemp(prefix="converged-metagrad-")) / "run"
        recorder = RunRecorder(run_dir, model, optimizer, scheduler=schedule, reduction=Reduction("token_mean"),
                               keep_states=keep_states)
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
            if recorder is not None:
                recorder.step(batch["id"])
            total, count = total + loss.item(), count + 1
        if epoch in keep:
            kept[epoch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            losses[epoch] = total / count
            if save is not None:  # as a Trainer run directory: checkpoint-<step>, with the tokenizer
                target = Path(save) / "run" / f"checkpoint-{epoch * ((len(corpus) + batch_size - 1) // batch_size)}"
                model.save_pretrained(target)
                tokenizer.save_pretrained(target)
    train_s = time.perf_counter() - started
    if recorder is not None:
        recorder.finish(model)
        if keep_run is not None:  # the recorded run, before the reverse pass writes its checkpoints beside it
            shutil.copytree(run_dir, keep_run, dirs_exist_ok=True)
            print(json.dumps({"kept run": str(keep_run)}), flush=True)
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
    if metagrad:
        out["attention"] = model.config._attn_implementation
        print(json.dumps({"rows so far": out}), flush=True)  # the metagradients take many times the rest
        if metagrad_last:
            out["metagrad"] = truncated_rows(run_dir, model, train, queries, truth, train_s, metagrad_last)
        else:
            out["metagrad"] = metagrad_rows(run_dir, model, train, queries, truth, train_s, metagrad_dtype,
                                            metagrad_tolerance)
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (0 with --metagrad)")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--save", help="also save each seed's run as DIR/seed-S/run/checkpoint-N (+ train.jsonl, "
                        "queries.jsonl): the input of gradtrace attribute")
    parser.add_argument("--metagrad", action="store_true", help="the declared variant: eager attention, the run "
                        "recorded, + metagradients and the metasmoothness check (issue #32)")
    parser.add_argument("--metagrad-dtype", choices=["float32", "float64"], default="float32", help="dtype of the "
                        "metagradients' replay (the run is trained and recorded in float32; float64: the declared "
                        "float64 variant)")
    parser.add_argument("--keep-run", metavar="DIR", help="with --metagrad: copy the recorded run to DIR (default: "
                        "deleted at the end)")
    parser.add_argument("--metagrad-tolerance", type=float, help="the replay check's bound (default: the "
                        "declared one; 1e30: no check in effect, the difference printed)")
    parser.add_argument("--metagrad-last", type=lambda text: [float(x) for x in text.split(",")], help="with "
                        "--metagrad: truncated passes over these shares of the last steps instead of the whole run "
                        "(the declared variant: 0.1,0.5)")
    parser.add_argument("--metagrad-keep-states", type=int, help="with --metagrad: RunRecorder(keep_states=N), the "
                        "state before every N-th step kept (the declared variant: 104)")
    args = parser.parse_args()
    seeds = args.seeds or ([0] if args.metagrad else [0, 1, 2])
    for seed in seeds:
        save = None if args.save is None else str(Path(args.save) / f"seed-{seed}")
        keep = None if args.keep_run is None else str(Path(args.keep_run) if len(seeds) == 1
                                                      else Path(args.keep_run) / f"seed-{seed}")
        print(json.dumps(run(seed, args.epochs, args.docs, save=save, metagrad=args.metagrad,
                             metagrad_dtype=args.metagrad_dtype, keep_run=keep,
                             metagrad_tolerance=args.metagrad_tolerance, metagrad_last=args.metagrad_last,
                             keep_states=args.metagrad_keep_states)),
              flush=True)


if __name__ == "__main__":
    main()
