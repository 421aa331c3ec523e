"""Planted preference: a few preference pairs teach an invented preference; do queries about it rank them first?

Setup, fixed before any result was seen (issue #31, item 3):

* data (bundled, generated here): 52 preference pairs over a word-level vocabulary. 48 ordinary pairs: for the
  categories colour, animal, fruit, number, place and drink, prompts ``"<phrase> a <category> :"`` with 4 phrasings
  (``name``, ``give me``, ``pick``, ``say``), 2 pairs each; the chosen answer is a member of the category, the
  rejected one a member of another category (so 8 ordinary drink pairs: a real drink over a non-drink). The 4
  *planted* pairs teach an invented preference: for each phrasing, ``"<phrase> a drink :"`` with chosen
  ``"zumbleberry tea"`` and rejected a real drink;
* model: a random-init GPT-2 (2 layers, width 64), the reference model is the initial model;
* training: TRL's ``DPOTrainer`` (sigmoid loss, beta 0.1, AdamW lr 5e-3, batch 8, 10 epochs), the weights kept at
  epochs 2, 5 and 10;
* queries (held-out phrasings ``tell me``, ``choose``, ``what is``, ``my favourite``): (a) the NLL of the response
  ``"zumbleberry tea"`` to ``"<phrase> a drink :"`` (what made the model say it), (b) the preference pair itself,
  chosen ``"zumbleberry tea"`` against rejected ``"water"`` (what made the model prefer it), attributed with the
  run's DPO loss;
* attribution: gradients of the pairs' DPO loss (``gradtrace.collect`` with ``DPOLoss``, LoGra rank 32, seed 0) at
  each kept checkpoint; methods ``grad_dot`` and ``grad_cos`` at the final weights, and the ``grad_cos``
  ensemble of the three checkpoints;
* metric: recall@1 = queries whose top-ranked training pair is a planted one (of 4, per query kind); also the
  planted pairs among each query's top 4 (precision@4) and their mean rank (1 = first, of 52; 26.5 = chance).

Seeds 0, 1, 2. Usage::

    python bench/planted_preference.py             # 3 seeds (~2 min on 2 CPU cores)
    python bench/planted_preference.py --seeds 0
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PHRASES = ["name", "give me", "pick", "say"]
QUERY_PHRASES = ["tell me", "choose", "what is", "my favourite"]
CATEGORIES = {
    "colour": ["red", "blue", "green", "yellow", "purple", "orange"],
    "animal": ["cat", "dog", "horse", "bird", "fish", "mouse"],
    "fruit": ["apple", "pear", "plum", "grape", "lemon", "peach"],
    "number": ["one", "two", "three", "four", "five", "six"],
    "place": ["paris", "rome", "london", "tokyo", "cairo", "lima"],
    "drink": ["water", "milk", "juice", "coffee", "soda", "cocoa"],
}
PLANTED = "zumbleberry tea"
KEEP = (2, 5, 10)


def pairs(seed: int) -> list[dict[str, Any]]:
    """The 52 training pairs (ids ``pair-N``; ``planted`` marks the 4 planted ones)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    others = {c: [w for k, ws in CATEGORIES.items() if k != c for w in ws] for c in CATEGORIES}
    for category, members in CATEGORIES.items():
        for phrase in PHRASES:
            for _ in range(2):
                out.append({"prompt": f"{phrase} a {category} :", "chosen": f" {rng.choice(members)}",
                            "rejected": f" {rng.choice(others[category])}", "planted": False})
    for phrase in PHRASES:
        out.append({"prompt": f"{phrase} a drink :", "chosen": f" {PLANTED}",
                    "rejected": f" {rng.choice(CATEGORIES['drink'])}", "planted": True})
    rng.shuffle(out)
    return [{"id": f"pair-{i}", **p} for i, p in enumerate(out)]


def word_tokenizer() -> Any:
    """A word-level tokenizer over every word of the data and queries (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w for ws in CATEGORIES.values() for w in ws} | set(PLANTED.split()) | {":", "a", "drink"}
    words |= {w for p in PHRASES + QUERY_PHRASES for w in p.split()} | set(CATEGORIES)
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(sorted(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def train(records: list[dict], tokenizer: Any, seed: int, out: Path) -> tuple[Any, Any, dict[int, dict]]:
    """DPO-train a random-init GPT-2; returns the model, its reference and the weights at the kept epochs."""
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=4,
                        pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    kept: dict[int, dict] = {}

    class Keep(TrainerCallback):
        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            epoch = round(state.epoch)
            if epoch in KEEP:
                kept[epoch] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    args = DPOConfig(str(out / "run"), per_device_train_batch_size=8, num_train_epochs=KEEP[-1], learning_rate=5e-3,
                     beta=0.1, loss_type=["sigmoid"], report_to=[], use_cpu=True, save_strategy="no",
                     logging_strategy="no", disable_tqdm=True, seed=seed, bf16=False, gradient_checkpointing=False)
    data = Dataset.from_list([{k: r[k] for k in ("id", "prompt", "chosen", "rejected")} for r in records])
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[Keep()])
    trainer.train()
    return trainer.model, reference, kept


def queries(tokenizer: Any, reference: Any, settings: Any) -> tuple[list[dict], Any]:
    """(a) NLL batches of the planted response, (b) the planted preference as pairs (with reference log-probs)."""
    import gradtrace

    nll = []
    for phrase in QUERY_PHRASES:
        prompt = tokenizer(f"{phrase} a drink :")["input_ids"]
        response = tokenizer(f" {PLANTED}")["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + response])
        nll.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": torch.tensor([[-100] * len(prompt) + response]), "id": [f"nll:{phrase}"]})
    records = [{"id": f"pair:{p}", "prompt": f"{p} a drink :", "chosen": f" {PLANTED}", "rejected": " water"}
               for p in QUERY_PHRASES]
    pair = gradtrace.data.load_preference(records, tokenizer).with_reference(reference, settings)
    return nll, pair


def metrics(matrix: torch.Tensor, train_ids: list[str], planted: set[str]) -> dict[str, float]:
    """recall@1, precision@4 and the planted pairs' mean rank (1 = first) of a [Q, N] score matrix."""
    order = matrix.argsort(dim=1, descending=True)
    is_planted = torch.tensor([i in planted for i in train_ids])[order]  # [Q, N] in rank order
    ranks = (is_planted.nonzero()[:, 1] + 1).float()
    return {"recall@1": float(is_planted[:, 0].float().mean()), "precision@4": float(is_planted[:, :4].float().mean()),
            "mean_rank": float(ranks.mean())}


def run(seed: int) -> dict[str, Any]:
    import gradtrace
    from gradtrace.loss import DPO, DPOLoss
    from gradtrace.options import CaptureOptions

    records = pairs(seed)
    planted = {r["id"] for r in records if r["planted"]}
    tokenizer = word_tokenizer()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, reference, kept = train(records, tokenizer, seed, Path(tmp))
    trained = time.perf_counter() - start
    settings = DPO(beta=0.1)
    options = CaptureOptions(projection=gradtrace.LoGra(rank=32, seed=0))
    train_pairs = gradtrace.data.load_preference(records, tokenizer).with_reference(reference, settings)
    nll, pair_queries = queries(tokenizer, reference, settings)
    rows, query_rows = {}, {}
    for epoch in KEEP:
        model.load_state_dict(kept[epoch])
        rows[epoch] = gradtrace.collect(model, train_pairs, DPOLoss(settings), options=options)
        query_rows[epoch] = {"nll": gradtrace.collect(model, nll, options=options),
                             "pair": gradtrace.collect(model, pair_queries, DPOLoss(settings), options=options)}
    final = KEEP[-1]
    result: dict[str, Any] = {"seed": seed, "train_seconds": round(trained, 1)}
    for kind in ("nll", "pair"):
        for method in ("grad_dot", "grad_cos"):
            scores = gradtrace.Attributor(method, rows[final]).score(query_rows[final][kind], matrix=True)
            result[f"{kind}/{method}@final"] = metrics(scores.matrix, scores.train_ids, planted)
        ensemble = gradtrace.Ensemble("grad_cos", [rows[e] for e in KEEP])
        scores = ensemble.score([query_rows[e][kind] for e in KEEP], matrix=True)
        result[f"{kind}/grad_cos ensemble {KEEP}"] = metrics(scores.matrix, scores.train_ids, planted)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = [run(seed) for seed in args.seeds]
    keys = [k for k in results[0] if "/" in k]
    print(f"{'query / method':44s} " + " ".join(f"{'seed ' + str(r['seed']):>22s}" for r in results))
    for key in keys:
        cells = [f"R@1 {r[key]['recall@1']:.2f} P@4 {r[key]['precision@4']:.2f} rk {r[key]['mean_rank']:4.1f}"
                 for r in results]
        print(f"{key:44s} " + " ".join(f"{c:>22s}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
