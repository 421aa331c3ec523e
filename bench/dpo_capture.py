"""DPO capture cost: per-pair LoGra collection against a DPO training step of the same model (issue #31, item 3).

Workload (fixed before any result was seen): a random-init GPT-2 (4 layers, width 256, 4 heads, vocabulary 8,192),
64 preference pairs whose prompt is 48 uniform random tokens and whose chosen and rejected completions are 80 random
tokens each (128 tokens per side), batches of 8 pairs (16 rows), fp32 on the CPU, the reference log-probabilities
precomputed (as TRL's ``precompute_ref_log_probs`` does; computing them is one no-grad forward per pair for both).
``train`` is TRL's step without its bookkeeping: the DPO loss of the batch (``gradtrace.loss.DPOLoss``, sigmoid,
beta 0.1, the same one forward of the 16 rows TRL's concatenated forward runs), mean over the pairs, one backward
(parameter gradients computed, no optimizer); ``collect`` is ``gradtrace.collect`` with ``DPOLoss`` and
``LoGra(rank=16)`` into a store, every parameter captured. The two take turns for ``--rounds`` rounds; the best
round of each is kept. Usage::

    python bench/dpo_capture.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import numpy as np
import torch


def workload() -> tuple[torch.nn.Module, object]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradtrace.data import PreferenceDataset
    from gradtrace.data.preference import PreferenceSummary
    from gradtrace.options.data import BatchOptions

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4))
    rng = np.random.default_rng(1)
    pairs, prompt, completion = 64, 48, 80
    chosen = rng.integers(2, 8192, size=(pairs, prompt + completion)).astype(np.int32)
    rejected = chosen.copy()  # the same prompt, another completion
    rejected[:, prompt:] = rng.integers(2, 8192, size=(pairs, completion))
    loss = np.zeros(chosen.shape, dtype=bool)
    loss[:, prompt:] = True
    lengths = np.full(pairs, prompt + completion, dtype=np.int64)
    tokens = {side: (rows.reshape(-1), loss.reshape(-1), lengths) for side, rows in (("chosen", chosen),
                                                                                     ("rejected", rejected))}
    summary = PreferenceSummary("bench", pairs, False, False, 2 * pairs * completion, 2 * pairs * (prompt + completion),
                                0, None, "data")
    reference = rng.normal(-700.0, 5.0, size=(pairs, 2)).astype(np.float32)
    data = PreferenceDataset(tokens, [f"pair{i}" for i in range(pairs)], summary,
                             batch_options=BatchOptions(batch_size=8, pad_id=0), reference=reference)
    return model, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import transformers

    import gradtrace
    from gradtrace.loss import DPOLoss
    from gradtrace.options import CaptureOptions, StoreOptions

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model, data = workload()
    loss = DPOLoss()
    options = CaptureOptions(projection=gradtrace.LoGra(rank=16))
    print(f"# {platform.machine()} {args.threads} threads, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; GPT-2 4x256, 64 pairs of 2 x 128 tokens, 8 pairs per batch, fp32, LoGra rank "
          f"16; best of {args.rounds} alternating rounds")

    def train() -> None:
        for batch in data:
            loss(model, batch).mean().backward()
        model.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory() as root:
        def collect() -> None:
            gradtrace.collect(model, data, loss, store=f"{root}/s", options=options,
                              store_options=StoreOptions(overwrite=True))

        train()
        collect()  # warm-up of both
        store = gradtrace.GradientStore.open(f"{root}/s")
        best = {"train": float("inf"), "collect": float("inf")}
        for _ in range(args.rounds):
            for name, fn in (("train", train), ("collect", collect)):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{len(store)} rows (one per pair) of width {store.spec.dim:,}")
        ratio = best["collect"] / best["train"]
        print(f"train {best['train']:.2f} s, collect {best['collect']:.2f} s, ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
