"""Per-example gradients captured while a Hugging Face ``Trainer`` trains, then: which documents taught a fact?

A small random-init GPT-2 learns Shakespeare plus eight planted documents with invented facts. A
``GradtraceCallback`` stores every document's LoGra-projected gradient during the last epoch; afterwards,
questions that paraphrase the planted facts are scored against the store. ``--peft`` trains LoRA adapters
instead of the whole model (only the adapters are captured).

    .venv/bin/python examples/hf_trainer.py [--peft] [--docs 64] [--epochs 3]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradtrace
from gradtrace.data.corpus import PLANTED, load_plays, train_tokenizer
from gradtrace.demo.report import report_planted
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions, StoreOptions


def main(out_dir: str | Path = "runs/hf_trainer", *, docs: int = 64, epochs: int = 3, batch_size: int = 8,
         accumulation: int = 2, width: int = 64, rank: int = 16, peft: bool = False, seed: int = 0,
         verbose: bool = True) -> dict[str, Any]:
    say = print if verbose else (lambda *a, **k: None)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    torch.manual_seed(seed)
    out = Path(out_dir)
    corpus = [(d.id, d.text) for d in load_plays(docs, seed=seed)] + [(p.id, p.text) for p in PLANTED]
    tokenizer = train_tokenizer([text for _, text in corpus], vocab_size=1024)
    data = Dataset.from_dict({"id": [i for i, _ in corpus],
                              "input_ids": [tokenizer(text).input_ids[:64] for _, text in corpus]})

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=width, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                 fan_in_fan_out=True, lora_dropout=0.0))

    def collate(features: list[dict]) -> dict:
        batch = tokenizer.pad({"input_ids": [f["input_ids"] for f in features]}, return_tensors="pt")
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    steps_per_epoch = math.ceil(math.ceil(len(data) / batch_size) / accumulation)
    logra = gradtrace.LoGra(rank=rank, seed=seed)
    callback = GradtraceCallback(out / "store", options=CaptureOptions(projection=logra),
                                 store_options=StoreOptions(dtype="int8", overwrite=True), ids="id",
                                 start_step=steps_per_epoch * (epochs - 1))  # the last epoch
    args = TrainingArguments(str(out / "trainer"), per_device_train_batch_size=batch_size, num_train_epochs=epochs,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3 if peft else 3e-3,
                             lr_scheduler_type="linear", save_strategy="epoch", logging_strategy="epoch",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=seed)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[callback])
    trainer.train()
    store = callback.result()
    train_seconds = time.perf_counter() - started

    # questions paraphrasing the planted facts, their gradients at the trained weights, scored against the store
    questions = [(f"query-{p.id.removeprefix('planted-')}", p.query) for p in PLANTED]
    batch = dict(collate([{"input_ids": tokenizer(q).input_ids} for _, q in questions]))
    batch["id"] = [i for i, _ in questions]
    queries = gradtrace.collect(trainer.model, [batch], options=CaptureOptions(projection=logra))
    scores = gradtrace.Attributor("grad_cos", store).score(queries, topk=3)
    say(f"\n{len(store)} documents x {store.dim} dims captured in the last epoch "
        f"({'LoRA adapters' if peft else 'all parameters'}; loss rule: "
        f"{store.manifest['config']['trainer']['loss']['rules']})")
    say(f"checkpoints recorded: {[c['step'] for c in gradtrace.integrations.hf.checkpoints(store)]}")
    hits = report_planted(scores, dict(corpus), say)
    seconds = time.perf_counter() - started
    say(f"\nrecall@1: {hits}/{len(questions)}; time {seconds:.1f} s (training with capture {train_seconds:.1f} s)")
    return {"store": store, "scores": scores, "recall_at_1": hits / len(questions), "seconds": seconds,
            "trainer": trainer}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/hf_trainer")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--peft", action="store_true")
    opts = parser.parse_args()
    main(opts.out, docs=opts.docs, epochs=opts.epochs, peft=opts.peft)
