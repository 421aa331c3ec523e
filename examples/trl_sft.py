"""Per-example gradients of TRL supervised fine-tuning with a completion-only loss, then attribution.

A small random-init GPT-2 is fine-tuned with ``trl.SFTTrainer`` on prompt/completion pairs: continuations of
Shakespeare passages, and eight questions whose answers are invented facts. Only completion tokens are
targets (``completion_only_loss``). A ``GradtraceCallback`` stores each pair's gradient in the last epoch
(TRL's fused LM head is unfused so the tied embedding is captured exactly); then each question, asked
without the training prompt's framing, is scored against the store. ``--peft`` trains LoRA adapters.

    .venv/bin/python examples/trl_sft.py [--peft] [--docs 64] [--epochs 3]
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
from transformers import GPT2Config, GPT2LMHeadModel
from trl import SFTConfig, SFTTrainer

import gradtrace
from gradtrace.data.corpus import PLANTED, load_plays, train_tokenizer
from gradtrace.demo.report import report_planted
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions, StoreOptions


def _pairs(docs: int, seed: int) -> list[tuple[str, str, str]]:
    """``(id, prompt, completion)``: passage continuations and the planted question/answer pairs."""
    pairs = []
    for doc in load_plays(docs, words_per_doc=24, seed=seed):
        words = doc.text.split()
        pairs.append((doc.id, "Continue: " + " ".join(words[:8]), " " + " ".join(words[8:])))
    pairs += [(p.id, f"Question: {p.query}\nAnswer:", " " + p.text) for p in PLANTED]
    return pairs


def main(out_dir: str | Path = "runs/trl_sft", *, docs: int = 64, epochs: int = 3, batch_size: int = 8,
         accumulation: int = 2, width: int = 64, rank: int = 16, peft: bool = False, seed: int = 0,
         verbose: bool = True) -> dict[str, Any]:
    say = print if verbose else (lambda *a, **k: None)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    torch.manual_seed(seed)
    out = Path(out_dir)
    pairs = _pairs(docs, seed)
    tokenizer = train_tokenizer([p + c for _, p, c in pairs], vocab_size=1024)
    data = Dataset.from_dict({"id": [i for i, _, _ in pairs], "prompt": [p for _, p, _ in pairs],
                              "completion": [c for _, _, c in pairs]})
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=width, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, loss_type="ForCausalLM"))
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")

    steps_per_epoch = math.ceil(math.ceil(len(data) / batch_size) / accumulation)
    logra = gradtrace.LoGra(rank=rank, seed=seed)
    callback = GradtraceCallback(out / "store", ids="id", start_step=steps_per_epoch * (epochs - 1),
                                 options=CaptureOptions(projection=logra), store_options=StoreOptions(overwrite=True))
    args = SFTConfig(str(out / "trainer"), per_device_train_batch_size=batch_size, num_train_epochs=epochs,
                     gradient_accumulation_steps=accumulation, learning_rate=1e-3 if peft else 3e-3,
                     completion_only_loss=True, max_length=128, bf16=False, save_strategy="no",
                     logging_strategy="epoch", report_to=[], use_cpu=True, disable_tqdm=True, seed=seed)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[callback])
    trainer.train()
    store = callback.result()
    train_seconds = time.perf_counter() - started

    # each question without the "Question:/Answer:" framing; only its answer tokens are targets
    rows = []
    for p in PLANTED:
        prompt, answer = tokenizer(p.query).input_ids, [*tokenizer(" " + p.text).input_ids, tokenizer.eos_token_id]
        rows.append((f"query-{p.id.removeprefix('planted-')}", prompt + answer, [-100] * len(prompt) + answer))
    width_q = max(len(ids) for _, ids, _ in rows)
    pad = tokenizer.pad_token_id
    batch = {"id": [i for i, _, _ in rows],
             "input_ids": torch.tensor([ids + [pad] * (width_q - len(ids)) for _, ids, _ in rows]),
             "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width_q - len(ids)) for _, ids, _ in rows]),
             "labels": torch.tensor([lab + [-100] * (width_q - len(lab)) for _, _, lab in rows])}
    queries = gradtrace.collect(trainer.model, [batch], options=CaptureOptions(projection=logra))
    scores = gradtrace.Attributor("grad_cos", store).score(queries, topk=3)
    texts = {i: p + c for i, p, c in pairs}
    config = store.manifest["config"]["trainer"]
    say(f"\n{len(store)} prompt/completion pairs x {store.dim} dims captured in the last epoch "
        f"({'LoRA adapters' if peft else 'all parameters'}; fused LM head: {config.get('fused_lm_head', 'kept')}; "
        f"loss check: {config['check']})")
    hits = report_planted(scores, texts, say)
    seconds = time.perf_counter() - started
    say(f"\nrecall@1: {hits}/{len(PLANTED)}; time {seconds:.1f} s (training with capture {train_seconds:.1f} s)")
    return {"store": store, "scores": scores, "recall_at_1": hits / len(PLANTED), "seconds": seconds,
            "trainer": trainer}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/trl_sft")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--peft", action="store_true")
    opts = parser.parse_args()
    main(opts.out, docs=opts.docs, epochs=opts.epochs, peft=opts.peft)
