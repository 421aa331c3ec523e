"""Per-completion gradients of TRL GRPO training, then a response scored against the rollouts.

A small random-init GPT-2 is trained with ``trl.GRPOTrainer`` on short prompts with a toy reward (the letters
"e" of the completion). A ``GradtraceCallback`` stores one row per completion: the gradient of the GRPO loss the
trainer optimised for it (``loss_type``, clipped ratio, KL term), with its prompt id, rollout, group, index in
the group and advantage. Then a response's negative log-likelihood is scored against the stored rollouts
(``grad_dot``: positive = training on that completion, as the trainer did, lowered the response's loss).

    .venv/bin/python examples/trl_grpo.py [--loss-type dapo] [--steps 4]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel
from trl import GRPOConfig, GRPOTrainer

import gradtrace
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions, StoreOptions

PROMPTS = ["Name a tree:", "Name a colour:", "Say hello:", "Count to three:", "Name a fruit:", "Describe the sea:",
           "Name an animal:", "Say goodbye:"]
WORDS = "tree green red blue hello three one two apple pear sea deep wave cat dog bee see you bye free here there"


def word_tokenizer() -> Any:
    """A word-level tokenizer over the prompts' and ``WORDS``' words (so that completions read as words)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in [*PROMPTS, WORDS] for w in text.replace(":", " :").lower().split()})
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and ":" apart
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>")


GENERATED: list[list[str]] = []  # the completions of each generation batch, in generation order


def reward_e(completions: list[str], **kwargs: Any) -> list[float]:
    """The toy reward: how many letters "e" the completion has (the completions are kept for display)."""
    GENERATED.append(list(completions))
    return [float(c.count("e")) for c in completions]


def completion_text(rollouts: list[str], rollout: str, group: int, k: int, generations: int) -> str:
    """A stored row's completion: the ``group * generations + k``-th of its rollout's generation batch (one
    process: the reward function saw the batch in that order)."""
    return GENERATED[rollouts.index(rollout)][group * generations + k]


def main(out_dir: str | Path = "runs/trl_grpo", *, loss_type: str = "dapo", steps: int = 4, generations: int = 4,
         width: int = 32, rank: int = 8, seed: int = 0, verbose: bool = True) -> dict[str, Any]:
    say = print if verbose else (lambda *a, **k: None)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    torch.manual_seed(seed)
    GENERATED.clear()
    out = Path(out_dir)
    tokenizer = word_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=width, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(out / "init")  # TRL builds the KL reference model from the policy's path
    model = GPT2LMHeadModel.from_pretrained(out / "init")
    data = Dataset.from_dict({"id": [f"p{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS})
    capturing = CaptureOptions(projection=gradtrace.LoGra(rank=rank, seed=seed))
    callback = GradtraceCallback(out / "store", ids="id", options=capturing, store_options=StoreOptions(overwrite=True))
    args = GRPOConfig(str(out / "trainer"), loss_type=loss_type, beta=0.04, num_generations=generations,
                      per_device_train_batch_size=8, gradient_accumulation_steps=2, max_completion_length=8,
                      max_steps=steps, learning_rate=1e-2, bf16=False, save_strategy="no", logging_strategy="no",
                      report_to=[], use_cpu=True, disable_tqdm=True, seed=seed)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_e, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    trainer.save_model()  # the output dir: the model `gradtrace score` loads for this store
    store = callback.result()
    train_seconds = time.perf_counter() - started

    fields = {n: store.field(n) for n in ("prompt", "rollout", "group", "completion", "advantage", "step")}
    loss = store.manifest["config"]["trainer"]["loss"]
    say(f"\n{len(store)} completions x {store.dim} dims captured (loss_type={loss['loss_type']}, "
        f"per completion: {loss['per_completion']}; scale: {loss['scale']})")
    say("first rows:")
    for i in range(min(6, len(store))):
        say(f"  {store.ids[i]:<12} prompt={fields['prompt'][i]} rollout={fields['rollout'][i]} "
            f"group={fields['group'][i]} k={fields['completion'][i]} advantage={fields['advantage'][i]:+.3f}")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in range(len(store)):
        groups[(fields["prompt"][i], fields["rollout"][i])].append(i)
    say(f"{len(groups)} (prompt, rollout) groups of {sorted({len(v) for v in groups.values()})} completions")

    # the query: a response's NLL (its prompt tokens are inputs, not targets)
    prompt, response = tokenizer("Name a tree:").input_ids, [*tokenizer(" green tree").input_ids,
                                                             tokenizer.eos_token_id]
    ids = torch.tensor([prompt + response])
    batch = {"id": ["query-tree"], "input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.tensor([[-100] * len(prompt) + response])}
    queries = gradtrace.collect(trainer.model, [batch], options=capturing)
    scores = gradtrace.Attributor("grad_dot", store).score(queries, topk=3)
    row = {ident: i for i, ident in enumerate(store.ids)}
    rollouts = sorted(set(fields["rollout"]), key=float)

    def text(i: int) -> str:
        return completion_text(rollouts, fields["rollout"][i], fields["group"][i], fields["completion"][i],
                               generations)
    say("\nquery-tree: 'Name a tree:' -> ' green tree'")
    for label, largest in (("most helpful", True), ("most harmful", False)):
        top = scores.topk(3, largest=largest)
        for ident, value in zip(top.ids[0], top.values[0].tolist()):
            i = row[ident]
            say(f"  {label}: {value:+.3e}  {ident:<9} advantage={fields['advantage'][i]:+.3f}  "
                f"{PROMPTS[int(fields['prompt'][i][1:])]!r} -> {text(i)!r}")
    matrix = scores.matrix[0]
    advantages = torch.tensor([a if a is not None else 0.0 for a in fields["advantage"]])
    by_prompt = {p: float(matrix[[i for i in range(len(store)) if fields["prompt"][i] == p]].sum())
                 for p in sorted(set(fields["prompt"]))}
    say("summed score by prompt: " + ", ".join(f"{p} {v:+.2e}" for p, v in by_prompt.items()))
    say(f"zero-advantage completions: {int((advantages == 0).sum())}, their largest |score|: "
        f"{float(matrix[advantages == 0].abs().max()) if bool((advantages == 0).any()) else 0.0:.1e}")
    seconds = time.perf_counter() - started
    say(f"time {seconds:.1f} s (training with capture {train_seconds:.1f} s)")
    return {"store": store, "scores": scores, "trainer": trainer, "seconds": seconds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/trl_grpo")
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--steps", type=int, default=4)
    opts = parser.parse_args()
    main(opts.out, loss_type=opts.loss_type, steps=opts.steps)
