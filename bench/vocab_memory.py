"""Peak memory of a bf16 LM head with a 128k vocabulary: a plain training step against gradtrace's passes, on the CPU.

The setup is fixed (chosen before any measurement; issue #30, item 2): a bf16 model that is an embedding and an LM
head (``hidden`` 512, ``vocab`` 128,000, untied, seed 0), on ``batch x length`` = 8 x 1024 = 8,192 tokens of random
ids; one thread. Only the head matters here -- the [tokens, vocab] logits, their float32 copies and their gradient --
so the model has no body: a real model's activations would add to both sides of every ratio, making capture's share
smaller, not larger. Cases, each in a fresh process after one warm-up call of the same kind on 1 x 16 tokens:

* ``plain``   -- forward, Hugging Face's ``ForCausalLMLoss`` (``logits.float()`` then mean cross-entropy), backward;
* ``capture`` -- the same step inside ``gradtrace.capture(model, Loss(reduction="token_mean"),
  options=CaptureOptions(projection=LoGra(rank=8), layers=["lm_head"]))``;
* ``collect`` -- ``gradtrace.collect`` of the same batch with the library's own loss (``causal_lm_loss``), same options;
* ``true_fisher`` -- one pass of ``fisher="true"`` (``fisher_passes``): labels sampled from the model, their
  per-example loss, backward (no capture: the sampling and the loss alone);
* ``trainer_check`` -- the Trainer integration's loss check (``loss_ratio``) on the output of a forward whose graph is
  alive, as ``GradtraceCallback`` runs it; measured alone, at 2 x 1024 tokens (the old code made 3 float32 [N, V]
  copies there, too many for this 23 GB machine at 8k tokens);
* ``fused_head`` -- the unfused TRL head's fields (``fused_outputs``) and the backward of its loss, at 2 x 1024 tokens
  (same reason: about five float32 copies before).

Each case reports the peak of its step over what existed before it, two ways: ``torch.profiler.profile(
profile_memory=True)`` (the CPU allocator's "Total Allocated", which counts only allocations made inside the profiled
region -- what a GPU's allocator would see) and the process's peak resident memory (``ru_maxrss`` after the step
minus ``VmRSS`` before it; untouched pages of an allocation are not resident, so it can be lower, and blocks the C
allocator keeps after a free are, so it can be higher; not given for the two cases that profile a region inside a
step, whose process peak may come before the region). ``N x V fp32`` is the size of one float32 copy of the
logits, the unit of the ``fp32_copies`` column (the allocator peak over it). Usage::

    python bench/vocab_memory.py              # every case, a markdown table
    python bench/vocab_memory.py --json       # one JSON object per case
    python bench/vocab_memory.py --case plain # one case in this process
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import types

VOCAB, HIDDEN, BATCH, LENGTH, SMALL_BATCH = 128_000, 512, 8, 1024, 2
CASES = ("plain", "capture", "collect", "true_fisher", "trainer_check", "fused_head")
GIB = 1024 ** 3


def _model():
    import torch
    from torch import nn
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutput

    class HeadForCausalLM(nn.Module):
        """An embedding and an LM head: the part of a language model whose memory scales with the vocabulary."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
            logits = self.lm_head(self.embed(input_ids))  # [B, T, V] bf16
            loss = None if labels is None else ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
            return CausalLMOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    return HeadForCausalLM().to(torch.bfloat16)


def _batch(batch: int, length: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def peak_allocated(fn) -> int:
    """Bytes the CPU allocator held at the peak of ``fn()`` over what it held when ``fn`` started
    (``torch.profiler``, ``profile_memory=True``); 0 when ``fn`` allocated nothing."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    memory = sorted((e["ts"], e["args"]) for e in events if e.get("name") == "[memory]")
    if not memory:
        return 0
    # "Total Allocated" carries over from an earlier profiled region of the process (what it allocated and freed
    # outside profiling is never subtracted): count from the total before this region's first event
    start_total = memory[0][1]["Total Allocated"] - memory[0][1]["Bytes"]
    return max(0, *(args["Total Allocated"] - start_total for _, args in memory))


def _profiled_peak(step) -> tuple[int, int, float]:
    """``(allocator peak, resident peak, seconds)`` of ``step()`` over what existed before it, in bytes."""
    rss_before, timing = _rss(), {}

    def timed() -> None:
        start = time.perf_counter()
        step()
        timing["seconds"] = time.perf_counter() - start

    peak = peak_allocated(timed)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak, rss_peak - rss_before, timing["seconds"]


def _steps(case: str, model):
    """``step(batch)`` of ``case``."""
    import gradtrace
    from gradtrace.fit.curvature.fisher import fisher_passes

    options = gradtrace.CaptureOptions(projection=gradtrace.LoGra(rank=8), layers=["lm_head"])
    if case == "plain":
        def step(b):
            model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()
            model.zero_grad(set_to_none=True)
    elif case == "capture":
        def step(b):
            with gradtrace.capture(model, gradtrace.Loss(reduction="token_mean"), options=options) as cap:
                model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()
            model.zero_grad(set_to_none=True)
            assert len(cap.batches) == 1
    elif case == "collect":
        def step(b):
            grads = gradtrace.collect(model, [b], options=options)
            assert len(grads) == b["input_ids"].shape[0]
    elif case == "true_fisher":
        def step(b):
            (loss_fn,) = fisher_passes(None, "true", b, seed=0)
            loss_fn(model, b).sum().backward()
            model.zero_grad(set_to_none=True)
    elif case == "trainer_check":
        from gradtrace.integrations.trainer_loss import CallLoss, loss_ratio

        def step(b):
            out = model(input_ids=b["input_ids"], labels=b["input_ids"])  # the graph stays alive, as in the Trainer
            call = CallLoss(num_items=None, world=1.0, accumulation=1, grad_scale=1.0, path="micro-batch token mean")
            found = {}
            step.peak = _profiled_peak(lambda: found.update(ratio=loss_ratio(out.loss, out, b["input_ids"], call,
                                                                              causal=True)))
            assert abs(found["ratio"] - 1) < 5e-3, found
            out.loss.backward()
            model.zero_grad(set_to_none=True)
    elif case == "fused_head":
        from gradtrace.integrations.fused_head import fused_outputs

        def step(b):
            logits = model(input_ids=b["input_ids"]).logits

            def fields_and_backward():
                fields = fused_outputs(logits, b["input_ids"], None, types.SimpleNamespace)
                fields.loss.backward()

            step.peak = _profiled_peak(fields_and_backward)
            model.zero_grad(set_to_none=True)
    else:
        raise ValueError(case)
    return step


def run_case(case: str) -> dict:
    import torch

    torch.set_num_threads(1)
    model = _model()
    step = _steps(case, model)
    step(_batch(1, 16))  # warm-up: threads, projection matrices, lazy imports
    small = case in ("trainer_check", "fused_head")
    batch = _batch(SMALL_BATCH if small else BATCH, LENGTH)
    if small:  # the case profiles its own region (the check or the head alone), inside the step
        step(batch)
        allocated, _, seconds = step.peak
        resident = None  # ru_maxrss is the process's: its peak may lie before the region (the forward's own loss)
    else:
        allocated, resident, seconds = _profiled_peak(lambda: step(batch))
    tokens = batch["input_ids"].numel()
    return {"case": case, "tokens": tokens, "vocab": VOCAB, "hidden": HIDDEN, "dtype": "bfloat16",
            "allocated_peak_gib": allocated / GIB, "resident_peak_gib": None if resident is None else resident / GIB,
            "fp32_copies": allocated / (tokens * VOCAB * 4), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=CASES, help="run one case in this process")
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        return
    import torch

    print(f"{platform.machine()} CPU, {os.cpu_count()} cores, python {platform.python_version()}, torch "
          f"{torch.__version__}, one thread; bf16 embedding + LM head, hidden {HIDDEN}, vocab {VOCAB:,}\n")
    plain = rows[0]["allocated_peak_gib"]
    print("| case | tokens | peak (profiler) | / plain | N x V fp32 copies | peak RSS | seconds |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['allocated_peak_gib'] / plain:.3f}" if row["tokens"] == rows[0]["tokens"] else "-"
        resident = "-" if row["resident_peak_gib"] is None else f"{row['resident_peak_gib']:.2f} GiB"
        print(f"| {row['case']} | {row['tokens']:,} | {row['allocated_peak_gib']:.2f} GiB | {ratio} | "
              f"{row['fp32_copies']:.2f} | {resident} | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
