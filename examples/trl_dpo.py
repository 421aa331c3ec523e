"""Per-pair gradients of TRL DPO training, then a preference and a response attributed to the training pairs.

A small random-init GPT-2 (word-level tokenizer, no download) is trained with ``trl.DPOTrainer`` on 52 bundled
preference pairs, 4 of which teach an invented preference (any "... a drink :" prompt: "zumbleberry tea" over a
real drink; ``bench/planted_preference.py``'s data). A ``GradtraceCallback`` stores one row per pair and step: the
gradient of that pair's own DPO loss at the step's weights. Then two queries are scored against the rows with
``grad_cos`` summed over the captured steps (each step's rows scored, TracIn-style, then added):

* a preference pair -- "zumbleberry tea" over "water" for a held-out prompt -- collected with the run's DPO loss
  (what made the model prefer this answer);
* the NLL of "zumbleberry tea" as the response to that prompt (what made the model say it).

Positive scores: a gradient step on that training pair lowers the query's loss.

    .venv/bin/python examples/trl_dpo.py [--epochs 6] [--rank 16]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel
from trl import DPOConfig, DPOTrainer

import gradtrace
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.loss import DPO, DPOLoss
from gradtrace.options import CaptureOptions, StoreOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from planted_preference import PLANTED, pairs, word_tokenizer

PROMPT = "tell me a drink :"


def step_scores(store: Any, queries: Any) -> dict[str, float]:
    """``grad_cos`` of the query against every stored row, summed per pair over the captured steps."""
    scores = gradtrace.Attributor("grad_cos", store).score(queries, topk=None, matrix=True)
    examples = store.field("example")
    total: dict[str, float] = defaultdict(float)
    for ident, example, value in zip(store.ids, examples, scores.matrix[0].tolist()):
        total[example if example is not None else ident] += value
    return dict(total)


def main(out_dir: str | Path = "runs/trl_dpo", *, epochs: int = 6, rank: int = 16, seed: int = 0,
         verbose: bool = True) -> dict[str, Any]:
    say = print if verbose else (lambda *a, **k: None)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    out = Path(out_dir)
    records = pairs(seed)
    planted = {r["id"] for r in records if r["planted"]}
    tokenizer = word_tokenizer()
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       pad_token_id=0, eos_token_id=1, bos_token_id=1))
    reference = copy.deepcopy(model)  # the policy before DPO
    capturing = CaptureOptions(projection=gradtrace.LoGra(rank=rank, seed=seed))
    callback = GradtraceCallback(out / "store", ids="id", options=capturing, trajectory=True,
                                 store_options=StoreOptions(overwrite=True))
    args = DPOConfig(str(out / "trainer"), per_device_train_batch_size=8, num_train_epochs=epochs,
                     learning_rate=5e-3, beta=0.1, report_to=[], use_cpu=True, save_strategy="no",
                     logging_strategy="no", disable_tqdm=True, seed=seed, bf16=False)
    data = Dataset.from_list([{k: r[k] for k in ("id", "prompt", "chosen", "rejected")} for r in records])
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[callback])
    trainer.train()
    store = callback.result()
    loss = store.manifest["config"]["trainer"]["loss"]
    say(f"{len(store)} rows (each pair once per epoch, at the weights of its step) x {store.dim} dims; loss "
        f"{loss['trainer_loss']} {loss['loss_type']} beta {loss['beta']}")

    settings = DPO.of(trainer.args)
    query_pair = gradtrace.data.load_preference(
        [{"id": "prefers-zumbleberry", "prompt": PROMPT, "chosen": f" {PLANTED}", "rejected": " water"}],
        tokenizer).with_reference(reference, settings)
    prompt, response = tokenizer(PROMPT)["input_ids"], tokenizer(f" {PLANTED}")["input_ids"] + [1]
    ids = torch.tensor([prompt + response])
    nll = [{"id": ["says-zumbleberry"], "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([[-100] * len(prompt) + response])}]
    text = {r["id"]: f"{r['prompt']}{r['chosen']}  (over{r['rejected']})" for r in records}
    results = {}
    for label, queries in (("preference pair", gradtrace.collect(trainer.model, query_pair, DPOLoss(settings),
                                                                  options=capturing)),
                           ("response NLL", gradtrace.collect(trainer.model, nll, options=capturing))):
        summed = step_scores(store, queries)
        ranked = sorted(summed, key=summed.get, reverse=True)
        results[label] = ranked
        say(f"\n{label}: {PROMPT!r} -> {PLANTED!r}; top pairs (grad_cos summed over steps):")
        for ident in ranked[:4]:
            say(f"  {summed[ident]:+.3f}  {ident:<8} {'[planted] ' if ident in planted else ''}{text[ident]}")
        say(f"  planted pairs' ranks: {sorted(ranked.index(i) + 1 for i in planted)} of {len(ranked)}")
    seconds = time.perf_counter() - started
    say(f"\ntime {seconds:.1f} s")
    return {"store": store, "ranked": results, "planted": planted, "seconds": seconds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_dpo")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    options = parser.parse_args()
    main(options.out, epochs=options.epochs, rank=options.rank)
