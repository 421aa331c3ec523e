"""LoGra projection products of a bf16 model: ``CaptureOptions.grad_dtype="float32"`` against ``"activation"``.

Two measurements, on whatever machine runs it (the dtype, shapes, torch version, threads and CPU/GPU are printed with
every number):

* ``project``: one :meth:`gradtrace.projection.logra.Projector.project` of a bf16 ``[tokens, n]`` factor to ``k``
  (an LM head's output gradient is ``n = V``): median time of 5 and the allocator peak over the output
  (``torch.profiler`` on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU);
* ``collect``: ``gradtrace.collect`` of a bf16 Llama-style model with a LoGra projection, in-memory: median time of
  3 and the relative difference / cosine of the rows against the float32 path.

Usage::

    python bench/projection_dtype.py [--device cuda] [--tokens 8192] [--n 32000] [--k 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions
from gradtrace.projection.logra import Projector

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vocab_memory import peak_allocated


def _peak(fn, device: torch.device) -> int:
    """Bytes allocated at the peak of ``fn()`` over what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return peak_allocated(fn)  # the CPU allocator's peak, as bench/vocab_memory.py measures it


def _median_time(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def project_case(tokens: int, n: int, k: int, device: torch.device) -> list[dict]:
    x = torch.randn(tokens, n, device=device).to(torch.bfloat16)
    spec = gradtrace.LoGra(rank=k)
    out = []
    for grad_dtype in ("float32", "activation"):
        projector = Projector(spec, grad_dtype)
        result = projector.project("p", "rows", x)  # the matrices generated and cached (not timed)
        step = lambda projector=projector: projector.project("p", "rows", x)
        seconds = _median_time(step, device, 5)
        peak = _peak(step, device)
        reference = x.double() @ projector.matrix("p", "rows", n, device).double().t()
        error = float((result.double() - reference).norm() / reference.norm())
        out.append({"case": "project", "grad_dtype": grad_dtype, "tokens": tokens, "n": n, "k": k,
                    "ms": round(seconds * 1e3, 2), "peak_MiB_over_output": round((peak - tokens * k * 4) / 2**20, 2),
                    "rel_error_vs_float64": f"{error:.2e}"})
    return out


def collect_case(device: torch.device, hidden: int, vocab: int, length: int, batch: int) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=length)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(1, vocab, (2 * batch, length), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i:i + batch]} for i in range(0, len(ids), batch)]
    run = gradtrace.RunOptions(device=device)
    rows, out = {}, []
    for grad_dtype in ("float32", "activation"):
        options = CaptureOptions(projection=gradtrace.LoGra(rank=16), grad_dtype=grad_dtype)
        collected = {}

        def go(options=options, collected=collected):
            collected["rows"] = gradtrace.collect(model, data, options=options, run=run).vectors

        go()  # warm-up
        seconds = _median_time(go, device, 3)
        rows[grad_dtype] = collected["rows"].double()
        out.append({"case": "collect", "grad_dtype": grad_dtype, "hidden": hidden, "vocab": vocab,
                    "tokens": len(ids) * length, "s": round(seconds, 3)})
    low, high = rows["activation"], rows["float32"]
    out[-1]["max_rel_diff_vs_float32"] = f"{float(((low - high).norm(dim=1) / high.norm(dim=1)).max()):.2e}"
    out[-1]["min_cosine_vs_float32"] = f"{float(F.cosine_similarity(low, high, dim=1).min()):.6f}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--n", type=int, default=32000)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
                      "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "dtype": "bfloat16"}))
    for row in project_case(args.tokens, args.n, args.k, device):
        print(json.dumps(row))
    for row in collect_case(device, args.hidden, args.vocab, args.length, args.batch):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
