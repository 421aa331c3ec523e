"""Storage quantization: do bf16 / int8 (per-row scale) stores rank training examples like float32?

Two workloads:

* ``demo``  -- the standard workload: the model ``gradtrace demo`` trains (GPT-2 2x128 on 800 Shakespeare
  documents + 8 planted facts), its training gradients captured during the last epoch with LoGra rank 64
  into a float32 store, and the 8 paraphrase queries;
* ``random`` -- a random-init GPT-2 4x256 (50k vocabulary), 256 training and 16 query sequences of 128
  random tokens, LoGra rank 8 and 32.

For each, the store rows are quantized, and the ``grad_dot`` and ``grad_cos`` scores of every query over
all training examples are compared with float32: Spearman rank correlation per query (mean and worst),
and how many of the float32 top-10 stay in the top-10.

    python bench/quantize.py
"""

from __future__ import annotations

import os
import platform
import tempfile

import torch

import gradtrace
from gradtrace.grad.quantize import quantize, spearman
from gradtrace.options import CaptureOptions


def _compare(name: str, train: torch.Tensor, queries: torch.Tensor) -> None:
    for method in ("grad_dot", "grad_cos"):
        def score(rows, method=method):
            if method == "grad_cos":
                rows = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
                q = queries / queries.norm(dim=1, keepdim=True).clamp(min=1e-12)
            else:
                q = queries
            return q @ rows.t()

        base = score(train)
        top = base.topk(10, dim=1).indices
        for mode in ("bf16", "int8"):
            approx = score(quantize(train, mode).dequantize())
            rho = spearman(base, approx)
            overlap = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, approx.topk(10, dim=1).indices)]
            print(f"{name:<25}{method:<10}{mode:<6}{float(rho.mean()):>10.5f}{float(rho.min()):>10.5f}"
                  f"{sum(overlap) / len(overlap):>10.1f}/10")


def demo_workload() -> None:
    from gradtrace.data.corpus import PLANTED
    from gradtrace.demo.run import run

    with tempfile.TemporaryDirectory() as tmp:
        result = run(tmp, dtype="float32", verbose=False)
        store = result["store"]
        train = store.read(0, len(store))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(f"{tmp}/model")
        tok = AutoTokenizer.from_pretrained(f"{tmp}/model")
        enc = tok([p.query for p in PLANTED], padding=True, return_tensors="pt")
        q = gradtrace.collect(model, [{**enc, "id": [p.id for p in PLANTED]}],
                              options=CaptureOptions(projection=gradtrace.LoGra(**_logra_args(store))))
        _compare("demo (LoGra 64)", train, q.vectors)


def _logra_args(store) -> dict:
    spec = store.spec.projection
    return {"rank": spec["rank_rows"], "rank_cols": spec["rank_cols"], "vector_rank": spec["vector_rank"],
            "seed": spec["seed"]}


def random_workload() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, 50257, (256, 128), generator=gen)
    queries = torch.randint(0, 50257, (16, 128), generator=gen)
    for rank in (8, 32):
        logra = gradtrace.LoGra(rank=rank)
        g = gradtrace.collect(model, [{"input_ids": train[i:i + 16]} for i in range(0, 256, 16)],
                              options=CaptureOptions(projection=logra))
        q = gradtrace.collect(model, [{"input_ids": queries}], options=CaptureOptions(projection=logra))
        _compare(f"random GPT-2 (LoGra {rank})", g.vectors, q.vectors)


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"# {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}; Spearman of each query's scores "
          "over all training examples vs float32")
    print(f"{'workload':<25}{'method':<10}{'dtype':<6}{'mean rho':>10}{'min rho':>10}{'top-10 kept':>13}")
    demo_workload()
    random_workload()


if __name__ == "__main__":
    main()
