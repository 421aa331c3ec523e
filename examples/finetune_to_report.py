"""A Hugging Face ``Trainer`` fine-tune trained far past convergence, as the input of ``gradtrace attribute``.

A small random-init GPT-2 learns Shakespeare plus eight planted documents with invented facts for ``--epochs``
epochs (default 40), saving a checkpoint every ``--save-every`` epochs with its tokenizer; the training data and
eight questions that paraphrase the planted facts are written as JSONL beside the run. Then, as a user would::

    .venv/bin/python examples/finetune_to_report.py --out runs/finetune
    gradtrace attribute runs/finetune/trainer runs/finetune/train.jsonl runs/finetune/questions.jsonl \\
        --max-length 64 --truncate --out runs/finetune/attribution

(the command this script prints at the end).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradtrace.data.corpus import PLANTED, load_plays, train_tokenizer


def main(out_dir: str | Path = "runs/finetune", *, docs: int = 200, epochs: int = 40, save_every: int = 10,
         batch_size: int = 16, width: int = 128, seed: int = 0) -> Path:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = [(d.id, d.text) for d in load_plays(docs, seed=seed)] + [(p.id, p.text) for p in PLANTED]
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in corpus)
    with open(out / "questions.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": f"query-{p.id}", "text": p.query}) + "\n" for p in PLANTED)
    tokenizer = train_tokenizer([text for _, text in corpus])
    data = Dataset.from_dict({"input_ids": [tokenizer(text).input_ids[:64] for _, text in corpus]})
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=width, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)

    def collate(features: list[dict]) -> dict:
        batch = tokenizer.pad({"input_ids": [f["input_ids"] for f in features]}, return_tensors="pt")
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    steps_per_epoch = math.ceil(len(data) / batch_size)
    args = TrainingArguments(str(out / "trainer"), per_device_train_batch_size=batch_size, num_train_epochs=epochs,
                             learning_rate=3e-3, lr_scheduler_type="linear", save_strategy="steps",
                             save_steps=steps_per_epoch * save_every, logging_strategy="epoch", report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=seed)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, processing_class=tokenizer)
    trainer.train()
    print(f"trained {epochs} epochs; checkpoints: "
          f"{sorted(p.name for p in (out / 'trainer').iterdir() if p.name.startswith('checkpoint-'))}")
    print(f"\nNext: gradtrace attribute {out / 'trainer'} {out / 'train.jsonl'} {out / 'questions.jsonl'} "
          f"--max-length 64 --truncate --out {out / 'attribution'}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/finetune")
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    opts = parser.parse_args()
    main(opts.out, docs=opts.docs, epochs=opts.epochs, save_every=opts.save_every)
