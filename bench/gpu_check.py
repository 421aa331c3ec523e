"""GPU checks of issue #30 (item 6): one script, one table, prepared to run unchanged on a CUDA machine.

Each check measures one claim on the device, against a stated bound, and reports one or more rows
``(check, value, bound, status, seconds, notes)``; ``status`` is ``pass``, ``fail``, ``skip`` (with the reason) or
``error`` (the exception). Checks are isolated: one that fails or raises does not stop the others. The exit status
is 1 when any row is ``fail`` or ``error``.

1. capture exactness: a random-init Llama (SDPA attention, non-reentrant gradient checkpointing, training mode,
   right-padded ragged batch, the Hugging Face token-mean loss): exact capture in float32 against a brute-force
   loop of per-example backward passes on the same device; LoGra rows (rank 8) of the bfloat16 model against the
   float32 rows of the same weights (cosine per row), and against the bfloat16 brute-force loop projected the way
   the capture projects.
2. host syncs: ``torch.cuda.set_sync_debug_mode("warn")`` warnings during one captured training step and per
   ``gradtrace.collect`` batch, for GPT-2 models of 2 and 8 layers (CUDA only); and, on any device, the host reads
   gradtrace's own code makes, counted by ``bench/host_reads.py``'s ``TorchFunctionMode``. A count must not grow
   with depth.
3. peak memory (``torch.cuda.max_memory_allocated``) of a plain training step against a captured step (LoGra
   rank 8), bfloat16 Llama with a 128,000-token vocabulary (CUDA only).
4. int8 store reproducibility: the same data collected twice into int8 stores on the device gives identical
   rows and scales; a CPU collection gives the same rows within one quantisation step.
5. CUDA against CPU: grad_dot scores (and the float32 rows) of a device collection against a CPU one.
6. tokens/s of ``gradtrace.collect`` (LoGra rank 8) against a plain training step (forward + backward) on the
   same model and batches, after warm-up, synchronised around the timings.
7. DDP over 2 GPUs (NCCL): per-example rows captured under DDP on two ranks against one process (needs two CUDA
   devices; ``--ddp-backend gloo`` runs the same launch on two CPU processes, which is how it is tested).
8. MoE experts (a random-init Qwen3-MoE, transformers' fused experts, every layer sparse): exact capture in float32
   of the experts, the routers and the rest against the brute-force loop on the same device (the row's notes say
   whether gradtrace's experts products ran as ``torch.nn.functional.grouped_mm`` or fell back to blocks, read from
   the kernel refusals ``gradtrace.capture.layers.experts`` records); LoGra rows (rank 8) of the bfloat16 model
   against the float32 rows of the same weights, over the rows whose every token is routed alike in both dtypes (a
   token whose top-k differs takes other experts: a jump, not round-off; those rows are reported apart); the time
   of ``gradtrace.collect`` (LoGra rank 16) against a training pass of the same model, against issue #31's 1.0x.
9. gpt-oss attention sinks (eager attention, trainable ``sinks``): per-example ``sinks`` gradients in float32
   against the brute-force loop, and 100% coverage in the capture's report and in a ``collect`` store's manifest.
10. metagradients: a tiny Llama trained on the device under ``gradtrace.replay.RunRecorder`` (SGD with momentum,
    weight decay, clipping); the replay's difference to the recorded final weights (0 where the kernels are
    deterministic), ``gradtrace.replay.metagradients`` on the device against the same recorded run replayed in
    float64 on the CPU, and the time of the metagradients over the training run's (informative).

Sizes (full; ``--quick`` in brackets), chosen so that the whole ``--device cuda`` run takes about 8 minutes on one
H200 by design (not yet measured on one): 1 Llama h=128 L=4 V=1,024, 8 rows <= 64 tokens (h=64 L=2 V=256, 4 rows
<= 16); 2 GPT-2 h=32, 2 and 8 layers; 3 bf16 Llama h=256 L=4 V=128,000, 8 x 1,024 tokens (L=2 V=32,000, 4 x 512);
4, 5 Llama h=128 L=4 V=1,024, 64 examples <= 64 tokens (h=64 L=2 V=256, 16 <= 24); 6 bf16 Llama h=512 L=4
V=32,000, 10 batches of 8 x 1,024 (h=256 L=2, 3 of 4 x 512); 7 GPT-2 h=32 L=2, 8 examples; 8 Qwen3-MoE h=128 L=2
V=1,024, 8 experts top-2, 8 rows <= 64 tokens (h=32 V=256, 6 experts, 4 rows <= 16), timed at bench/moe_capture.py's
workload in bf16: h=256 L=4 V=8,192, 16 experts top-4, 64 x 128 tokens in batches of 8 (L=2, 32 x 128); 9 gpt-oss
h=64 L=4 V=1,024, 8 rows <= 64 tokens (h=32 L=2 V=256, 4 rows <= 16); 10 Llama h=64 L=2 V=256, 32 examples of 32
tokens, 12 steps of 8, 3 queries (h=16 L=1 V=64, 8 of 8 tokens, 4 steps of 4). Checks 8-10 are small next to 3
and 6: under a minute together on a GPU, most of it check 10's float64 CPU reference (about a minute on 2 CPU
cores).

Usage::

    python bench/gpu_check.py                          # --device cuda when there is one, else cpu
    python bench/gpu_check.py --device cuda --out docs/gpu.md
    python bench/gpu_check.py --device cpu --quick     # the CPU-side parts (tests/test_gpu_check.py)
    python bench/gpu_check.py --only 3,6               # some checks

``--out FILE`` writes the table as markdown: between the ``<!-- gpu_check:begin -->`` and
``<!-- gpu_check:end -->`` markers when the file has them (the rest of the page is kept), else as a page of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions, Loss, RunOptions, StoreOptions

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
STATUSES = ("pass", "fail", "skip", "error")
FP32_RTOL = 1e-4  # max |a - b| / max |b| between two float32 computations of the same gradients (round-off only)
BF16_COSINE = 0.999  # per-row cosine of bfloat16 LoGra rows with float32 ones (about 4.5% relative error)
MEMORY_RATIO = 1.10
SPEED_RATIO = 0.5  # collect's tokens/s over a training step's: a regression guard, not a measured target
META_RTOL = FP32_RTOL  # metagradients of a float32 run vs float64: round-off only (CPU: 2e-7 to 5e-7, 4 to 12 steps)
MOE_TARGET = 1.0  # issue #31: LoGra collection of a fused-experts model within 1.0x a training pass


@dataclass
class Row:
    check: str  # "1a", "1b", ...
    name: str
    value: str
    bound: str
    status: str  # one of STATUSES
    notes: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Context:
    device: torch.device
    quick: bool
    tmp: Path
    ddp_backend: str  # "auto", "nccl" or "gloo"
    self_compare: bool = False  # run the device-vs-CPU comparisons (4b, 5) on a CPU device too (tests them)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def compare_cpu(self) -> bool:
        return self.cuda or self.self_compare


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float32 (0 for an all-zero reference equal to ``got``)."""
    got, ref = got.float().cpu(), ref.float().cpu()
    scale = float(ref.abs().max())
    diff = float((got - ref).abs().max())
    return diff / scale if scale > 0 else diff


def drop(batch: Any) -> None:
    """A capture callback that keeps nothing (as a store writer would consume the rows)."""


# ---------------------------------------------------------------------------------------------- models and data
def llama(vocab: int, hidden: int, layers: int, *, heads: int = 4, kv_heads: int = 2, positions: int = 2048,
          seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).float()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def gpt2(layers: int, *, vocab: int = 128, hidden: int = 32, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=layers, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return GPT2LMHeadModel(config).float()


def _sharpen(model, hidden: int, seed: int = 11):
    """Expert and router weights of std ``0.3 * sqrt(16 / hidden)`` (``tests/capture/test_experts.py``'s 0.3 at width
    16), larger than the default init, so that the routers' and the experts' gradients are not tiny."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or ".gate.weight" in name or ".router." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 * (16 / hidden) ** 0.5)
    return model


def qwen3_moe(vocab: int, hidden: int, layers: int, experts: int, top_k: int, *, seed: int = 0):
    """A random-init Qwen3-MoE (transformers' fused experts, every layer sparse, no load-balancing loss)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                            num_experts_per_tok=top_k, max_position_embeddings=2048, norm_topk_prob=True,
                            router_aux_loss_coef=0.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, attn_implementation="sdpa")
    return _sharpen(Qwen3MoeForCausalLM(config).float(), hidden)


SINKS = (-3.0, 0.0, 1.5, 4.0)  # per head: sink probabilities from small to large (as test_attention_sinks.py)


def gpt_oss(vocab: int, hidden: int, layers: int, *, seed: int = 0):
    """A random-init gpt-oss: eager attention with trainable ``sinks`` (4 heads, far from 0), sliding-window and full
    layers alternating, 4 experts top-2 with biases."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden // 2,
                          num_hidden_layers=layers, num_attention_heads=len(SINKS), num_key_value_heads=2,
                          head_dim=hidden // len(SINKS), num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=2048, sliding_window=8, router_aux_loss_coef=0.0,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          attn_implementation="eager")
    model = _sharpen(GptOssForCausalLM(config).float(), hidden)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.tensor(SINKS) + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def padded_batch(lengths: list[int], vocab: int, seed: int = 1) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Rows of random tokens (``rows[i]``: ``[lengths[i]]``) and their right-padded batch with labels."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = row
        attention_mask[i, :len(row)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return rows, {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def id_batches(rows: int, length: int, vocab: int, per_batch: int, seed: int = 2) -> list[dict[str, Any]]:
    """``rows`` examples of ragged lengths (``length // 2`` to ``length``) in right-padded batches with ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=gen).tolist()
    out = []
    for start in range(0, rows, per_batch):
        _, batch = padded_batch(lengths[start:start + per_batch], vocab, seed=seed + start)
        out.append({"id": [f"ex{i}" for i in range(start, min(rows, start + per_batch))], **batch})
    return out


def brute_force(model, rows: list[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``{name: [E, *shape]}``: one backward pass per unpadded example of its summed token loss."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for row in rows:
        model.zero_grad(set_to_none=True)
        ids = row.unsqueeze(0).to(device)  # [1, T]
        (model(input_ids=ids, labels=ids, use_cache=False).loss * (len(row) - 1)).backward()
        for n, p in params.items():
            out[n].append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def capture_step(model, batch: dict[str, torch.Tensor], projection: gradtrace.LoGra | None):
    """The ``gradtrace.capture`` of one training step (token-mean loss): its one batch, report and coverage."""
    with gradtrace.capture(model, Loss(reduction="token_mean"),
                           options=CaptureOptions(projection=projection)) as cap:
        model(**batch, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    assert len(cap.batches) == 1 and cap.report().ok, str(cap.report())
    return cap


def captured(model, batch: dict[str, torch.Tensor], projection: gradtrace.LoGra | None):
    """The one ``GradientBatch`` of a training step (token-mean loss) under ``gradtrace.capture``."""
    return capture_step(model, batch, projection).batches[0]


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall seconds of ``fn()``, synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- 1. exactness
def check_exactness(ctx: Context) -> Iterator[Row]:
    dev = ctx.device
    vocab, hidden, layers = (256, 64, 2) if ctx.quick else (1024, 128, 4)
    lengths = [12, 16, 7, 10] if ctx.quick else [48, 64, 17, 33, 64, 25, 40, 9]
    setup = (f"Llama h={hidden} L={layers} V={vocab}, sdpa, non-reentrant checkpointing, batch {len(lengths)} "
             f"ragged to {max(lengths)} tokens, on {dev}")

    def prepared(dtype: torch.dtype):
        model = llama(vocab, hidden, layers).to(dev, dtype)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    rows, batch = padded_batch(lengths, vocab)
    batch = to(batch, dev)
    model32 = prepared(torch.float32)
    got = captured(model32, batch, None).per_example_grads()
    ref = brute_force(model32, rows, dev)
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    yield Row("1a", "exact capture vs brute force, float32", f"{errs[worst]:.1e}",
              f"<= {FP32_RTOL:g} (max abs err / max abs ref, worst parameter)", verdict(errs[worst] <= FP32_RTOL),
              f"{setup}; worst: {worst}")

    logra = gradtrace.LoGra(rank=8, seed=0)
    rows32 = captured(model32, batch, logra).flat()  # [E, D]
    model16 = prepared(torch.bfloat16)
    model16.load_state_dict(model32.state_dict())
    batch16 = captured(model16, batch, logra)
    rows16 = batch16.flat()
    cos32 = F.cosine_similarity(rows16.float(), rows32.float(), dim=1)  # [E]
    # the bf16 loop, projected the way the capture projects (P_rows G P_cols^T per matrix, P g per vector)
    ref16 = brute_force(model16, rows, dev)
    projector = logra.projector
    loop16 = torch.cat([projector.project_full(n, ref16[n], tuple(ref16[n].shape[1:])) for n in batch16.params], 1)
    cos_loop = F.cosine_similarity(rows16.float(), loop16.float(), dim=1)
    cos_loop32 = F.cosine_similarity(loop16.float(), rows32.float(), dim=1)
    yield Row("1b", "bf16 LoGra rows vs float32 rows", f"min cos {float(cos32.min()):.5f}",
              f">= {BF16_COSINE} per row", verdict(float(cos32.min()) >= BF16_COSINE),
              f"LoGra rank 8, {rows32.shape[1]} dims; the bf16 brute-force loop is at min cos "
              f"{float(cos_loop32.min()):.5f} from float32")
    yield Row("1c", "bf16 LoGra rows vs bf16 brute-force loop", f"min cos {float(cos_loop.min()):.5f}",
              f">= {BF16_COSINE} per row", verdict(float(cos_loop.min()) >= BF16_COSINE),
              "the loop: one bf16 backward per unpadded example, projected with the capture's matrices")


# ---------------------------------------------------------------------------------------------- 2. host syncs
def _host_reads_module():
    spec = importlib.util.spec_from_file_location("gpu_check_host_reads", ROOT / "bench" / "host_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def cuda_syncs(device: torch.device) -> Iterator[list]:
    """Record the ``set_sync_debug_mode("warn")`` warnings of the block (a list of ``warnings.WarningMessage``)."""
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    caught[:] = [w for w in caught if "synchroniz" in str(w.message)]


def _sync_workload(layers: int, device: torch.device):
    """A GPT-2 of ``layers`` layers and a padded batch, and three steps to count: a plain training step, one
    captured step (LoGra rank 4, after a warm-up step in the same capture) and a ``collect`` of ``n`` batches."""
    model = gpt2(layers).to(device)
    model.train()
    _, batch = padded_batch([16, 10, 16, 5], 128)
    batch = to(batch, device)
    logra = gradtrace.LoGra(rank=4)

    def plain() -> Callable[[], None]:
        def step() -> None:
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        return step

    @contextlib.contextmanager
    def capturing() -> Iterator[Callable[[], None]]:
        with gradtrace.capture(model, Loss(reduction="token_mean"), options=CaptureOptions(projection=logra),
                               callbacks=[drop]):
            plain()()  # warm-up: projection matrices, norm probes
            yield plain()

    def collect(n: int) -> None:
        data = [{"id": [f"b{b}e{i}" for i in range(4)], **batch} for b in range(n)]
        gradtrace.collect(model, data, options=CaptureOptions(projection=logra), run=RunOptions(device=device))

    return plain(), capturing, collect


def check_host_syncs(ctx: Context) -> Iterator[Row]:
    dev = ctx.device
    setup = "GPT-2 h=32 V=128, 4 padded rows of <= 16 tokens, LoGra rank 4"
    if ctx.cuda:
        counts = {}
        for layers in (2, 8):
            plain, capturing, collect = _sync_workload(layers, dev)
            plain()
            with cuda_syncs(dev) as caught:
                plain()
            base = len(caught)
            with capturing() as step, cuda_syncs(dev) as caught:
                step()
            step_syncs = len(caught)
            collect(1)  # warm-up
            with cuda_syncs(dev) as caught:
                collect(1)
            one = len(caught)
            with cuda_syncs(dev) as caught:
                collect(3)
            sites = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught})
            counts[layers] = (base, step_syncs, one, (len(caught) - one) / 2, sites)
        (b2, s2, o2, p2, _), (b8, s8, o8, p8, sites) = counts[2], counts[8]
        yield Row("2a", "CUDA syncs per captured training step", f"2L: {s2 - b2}, 8L: {s8 - b8}",
                  "8L <= 2L (captured minus plain step)", verdict(s8 - b8 <= s2 - b2),
                  f"{setup}; plain step alone: 2L {b2}, 8L {b8}; torch.cuda.set_sync_debug_mode('warn')")
        yield Row("2b", "CUDA syncs per collect batch", f"2L: {p2:g}, 8L: {p8:g}", "8L <= 2L", verdict(p8 <= p2),
                  f"(3 batches - 1 batch) / 2; a whole 1-batch collect: 2L {o2}, 8L {o8} (once-per-run work "
                  f"included); 8L sites: {', '.join(sites[:6]) or 'none'}")
    else:
        reason = "needs CUDA (torch.cuda.set_sync_debug_mode); rows 2c and 2d count the host reads on any device"
        yield Row("2a", "CUDA syncs per captured training step", "-", "8L <= 2L", "skip", reason)
        yield Row("2b", "CUDA syncs per collect batch", "-", "8L <= 2L", "skip", reason)

    HostReads = _host_reads_module().HostReads

    def gradtrace_reads(fn: Callable[[], None]) -> int:
        with HostReads() as reads:
            fn()
        return sum(n for (_, where), n in reads.sites.items() if where != "model")

    from gradtrace.capture import assemble

    reads = {}
    fast_path = getattr(assemble, "CPU_FAST_PATH", None)
    assemble.CPU_FAST_PATH = False  # the path a device takes (on the CPU a read waits for nothing), as host_reads.py
    try:
        for layers in (2, 8):
            plain, capturing, collect = _sync_workload(layers, dev)
            with capturing() as step:
                per_step = gradtrace_reads(step)
            one = gradtrace_reads(lambda collect=collect: collect(1))
            two = gradtrace_reads(lambda collect=collect: collect(2))
            reads[layers] = (per_step, two - one, one)
    finally:
        if fast_path is None:
            del assemble.CPU_FAST_PATH
        else:
            assemble.CPU_FAST_PATH = fast_path
    yield Row("2c", "host reads per captured step (gradtrace code)", f"2L: {reads[2][0]}, 8L: {reads[8][0]}",
              "8L <= 2L", verdict(reads[8][0] <= reads[2][0]),
              f"{setup}; bench/host_reads.py's TorchFunctionMode (.item, bool, tolist, .cpu, nonzero, mask indexing)"
              f" on {dev}, the device path (assemble.CPU_FAST_PATH off)")
    yield Row("2d", "host reads per collect batch (gradtrace code)", f"2L: {reads[2][1]:g}, 8L: {reads[8][1]:g}",
              "8L <= 2L", verdict(reads[8][1] <= reads[2][1]),
              f"2 batches - 1 batch; a whole 1-batch collect: 2L {reads[2][2]}, 8L {reads[8][2]}")


# ---------------------------------------------------------------------------------------------- 3. peak memory
def check_memory(ctx: Context) -> Iterator[Row]:
    vocab, hidden, layers, rows, length = (32_000, 256, 2, 4, 512) if ctx.quick else (128_000, 256, 4, 8, 1024)
    if not ctx.cuda:
        yield Row("3", "peak memory: captured / plain step", "-", f"<= {MEMORY_RATIO}", "skip",
                  "needs CUDA (torch.cuda.max_memory_allocated); CPU peaks: bench/capture_overhead.py, "
                  "bench/collect_memory.py")
        return
    dev = ctx.device
    model = llama(vocab, hidden, layers, heads=4, kv_heads=4).to(dev, torch.bfloat16)
    model.train()
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab, (rows, length), generator=gen).to(dev)  # [B, T]
    batch = {"input_ids": input_ids, "labels": input_ids}

    def step() -> None:
        model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    def peak(fn: Callable[[], None]) -> tuple[float, float]:
        fn()  # warm-up: allocator pools, projection matrices
        gc.collect()
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        sync(dev)
        return torch.cuda.max_memory_allocated(dev) / 2**30, before / 2**30

    plain, base = peak(step)
    with gradtrace.capture(model, Loss(reduction="token_mean"),
                           options=CaptureOptions(projection=gradtrace.LoGra(rank=8)), callbacks=[drop]):
        capture_peak, _ = peak(step)
    ratio = capture_peak / plain
    yield Row("3", "peak memory: captured / plain step", f"{ratio:.3f} ({capture_peak:.2f} / {plain:.2f} GiB)",
              f"<= {MEMORY_RATIO}", verdict(ratio <= MEMORY_RATIO),
              f"bf16 Llama h={hidden} L={layers} V={vocab:,}, {rows} x {length} tokens, LoGra rank 8, "
              f"{base:.2f} GiB allocated before the step (weights)")


# ---------------------------------------------------------------------------------------------- 4. int8 stores
def _collect_model(ctx: Context):
    vocab, hidden, layers = (256, 64, 2) if ctx.quick else (1024, 128, 4)
    rows, length = (16, 24) if ctx.quick else (64, 64)
    return (lambda: llama(vocab, hidden, layers)), id_batches(rows, length, vocab, per_batch=4), \
        f"Llama h={hidden} L={layers} V={vocab}, {rows} examples of <= {length} tokens in batches of 4, LoGra rank 8"


def _collect(model, data: list, device: torch.device, store: Path | None, dtype: str = "float32"):
    return gradtrace.collect(model.to(device), data, store=store,
                             options=CaptureOptions(projection=gradtrace.LoGra(rank=8)),
                             store_options=StoreOptions(dtype=dtype, overwrite=store is not None) if store else None,
                             run=RunOptions(device=device))


def _raw(store) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 store's unscaled rows ``[N, D]`` and scales ``[N]``."""
    scales = torch.empty(len(store))
    return store.read(0, len(store), scales=scales), scales


def check_int8(ctx: Context) -> Iterator[Row]:
    make, data, setup = _collect_model(ctx)
    dev = ctx.device
    runs = [_raw(_collect(make(), data, dev, ctx.tmp / f"int8-{i}", "int8")) for i in range(2)]
    (q0, s0), (q1, s1) = runs
    same = torch.equal(q0, q1) and torch.equal(s0, s1)
    steps = float(((q0 * s0[:, None] - q1 * s1[:, None]).abs() / s0.clamp(min=1e-30)[:, None]).max())
    yield Row("4a", "int8 store: two device collections", "identical" if same else f"differ by {steps:.2f} steps",
              "identical rows and scales", verdict(same), f"{setup}, on {dev}")
    if not same and ctx.cuda:  # does torch.use_deterministic_algorithms make them identical?
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                again = [_raw(_collect(make(), data, dev, ctx.tmp / f"int8-det-{i}", "int8")) for i in range(2)]
        finally:
            torch.use_deterministic_algorithms(False)
        det = torch.equal(again[0][0], again[1][0]) and torch.equal(again[0][1], again[1][1])
        kinds = sorted({str(w.message).split(" does not have a deterministic")[0][:60] for w in caught
                        if "deterministic" in str(w.message)})
        yield Row("4a'", "int8 store: two collections, deterministic algorithms", "identical" if det else "differ",
                  "identical rows and scales", verdict(det),
                  f"torch.use_deterministic_algorithms(True, warn_only=True); ops without one: {kinds or 'none'}")
    if not ctx.compare_cpu:
        yield Row("4b", "int8 store: device vs CPU collection", "-", "within 1 quantisation step", "skip",
                  "--device is the CPU: the reference would be the same computation")
        return
    qc, sc = _raw(_collect(make(), data, torch.device("cpu"), ctx.tmp / "int8-cpu", "int8"))
    decoded, decoded_cpu = q0 * s0[:, None], qc * sc[:, None]  # [N, D]
    step = torch.maximum(s0, sc)[:, None].clamp(min=1e-30)
    worst = float(((decoded - decoded_cpu).abs() / step).max())
    codes = int((q0 - qc).abs().max())
    # each side is within half a step of its float32 value, and the float32 values differ by round-off only
    yield Row("4b", "int8 store: device vs CPU collection", f"{worst:.2f} steps (codes differ by <= {codes})",
              "<= 1.01 steps per value", verdict(worst <= 1.01),
              f"step: the larger of the two rows' scales (max |row| / 127); scales rel. err "
              f"{rel_err(s0, sc):.1e}")


# ---------------------------------------------------------------------------------------------- 5. CUDA vs CPU
def check_scores(ctx: Context) -> Iterator[Row]:
    if not ctx.compare_cpu:
        yield Row("5", "grad_dot scores: device vs CPU", "-", f"<= {FP32_RTOL:g}", "skip",
                  "--device is the CPU: nothing to compare it with")
        return
    make, data, setup = _collect_model(ctx)
    queries = id_batches(4, 24, make().config.vocab_size, per_batch=4, seed=9)
    results = []
    for where, device in (("device", ctx.device), ("cpu", torch.device("cpu"))):
        store = _collect(make(), data, device, ctx.tmp / f"scores-{where}")
        query_rows = _collect(make(), queries, device, None)
        scores = gradtrace.Attributor("grad_dot", store, device=device).score(query_rows)
        results.append((scores.matrix, store.read(0, len(store))))
    (dev_scores, dev_rows), (cpu_scores, cpu_rows) = results
    err = rel_err(dev_scores, cpu_scores)
    same_top = torch.equal(dev_scores.argmax(1).cpu(), cpu_scores.argmax(1))
    yield Row("5", "grad_dot scores: device vs CPU", f"{err:.1e}", f"<= {FP32_RTOL:g} (max abs err / max abs score)",
              verdict(err <= FP32_RTOL),
              f"{setup}, float32 stores, 4 queries; rows rel. err {rel_err(dev_rows, cpu_rows):.1e}; "
              f"same top-1: {same_top}")


# ---------------------------------------------------------------------------------------------- 6. tokens/s
def train_and_collect(model, batches: list, on_device: list, options: CaptureOptions, dev: torch.device):
    """``(train, collect)``: a plain training pass over ``on_device`` (forward + backward, no optimizer) and
    ``gradtrace.collect`` of ``batches`` with ``options`` on ``dev`` -- the two sides of a throughput check."""
    def train() -> None:
        for batch in on_device:
            model(**batch, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

    def collect() -> None:
        gradtrace.collect(model, batches, options=options, run=RunOptions(device=dev))

    return train, collect


def check_throughput(ctx: Context) -> Iterator[Row]:
    dev = ctx.device
    if ctx.cuda:
        vocab, hidden, layers, rows, length, dtype = (32_000, 256, 2, 4, 512, torch.bfloat16) if ctx.quick else \
            (32_000, 512, 4, 8, 1024, torch.bfloat16)
    else:
        vocab, hidden, layers, rows, length, dtype = (1000, 128, 2, 4, 128, torch.float32) if ctx.quick else \
            (2000, 128, 4, 8, 128, torch.float32)
    steps = 3 if ctx.quick else 10
    model = llama(vocab, hidden, layers, heads=4, kv_heads=4).to(dev, dtype)
    gen = torch.Generator().manual_seed(4)
    batches = []
    for s in range(steps):
        input_ids = torch.randint(3, vocab, (rows, length), generator=gen)  # [B, T]
        batches.append({"id": [f"s{s}e{i}" for i in range(rows)], "input_ids": input_ids, "labels": input_ids})
    on_device = [to({k: v for k, v in b.items() if k != "id"}, dev) for b in batches]
    options = CaptureOptions(projection=gradtrace.LoGra(rank=8))

    train, collect = train_and_collect(model, batches, on_device, options, dev)

    model.train()
    train()  # warm-up
    collect()
    best = {"train": float("inf"), "collect": float("inf")}
    for _ in range(2):  # alternate, best of two: machine drift hits both alike
        model.train()
        best["train"] = min(best["train"], timed(train, dev))
        best["collect"] = min(best["collect"], timed(collect, dev))
    tokens = steps * rows * length
    train_rate, collect_rate = tokens / best["train"], tokens / best["collect"]
    ratio = collect_rate / train_rate
    yield Row("6", "tokens/s: collect / training step", f"{ratio:.2f} ({collect_rate:,.0f} / {train_rate:,.0f})",
              f">= {SPEED_RATIO} (regression guard)", verdict(ratio >= SPEED_RATIO),
              f"{str(dtype).removeprefix('torch.')} Llama h={hidden} L={layers} V={vocab:,}, {steps} batches of "
              f"{rows} x {length} tokens, LoGra rank 8 in memory; training step: forward + backward, no optimizer; "
              f"best of 2 after warm-up, on {dev}")


# ---------------------------------------------------------------------------------------------- 7. DDP
DDP_EXAMPLES, DDP_PER_STEP = 8, 2


def _ddp_data(vocab: int) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """The 8 examples (ids, and 8 one-row batches of a right-padded batch: each keeps the common width)."""
    _, batch = padded_batch([10, 7, 9, 4, 10, 6, 8, 5], vocab, seed=5)
    return [f"ex{i}" for i in range(DDP_EXAMPLES)], [{k: v[i:i + 1] for k, v in batch.items()}
                                                      for i in range(DDP_EXAMPLES)]


def _ddp_rows(model, ids: list[str], rows: list[dict[str, torch.Tensor]], device: torch.device,
              per_step: int) -> dict[str, torch.Tensor]:
    """``{id: LoGra row}`` of a capture over ``rows`` in steps of ``per_step`` examples (token-mean loss)."""
    out = {}
    with gradtrace.capture(model, Loss(reduction="token_mean"),
                           options=CaptureOptions(projection=gradtrace.LoGra(rank=8, seed=0)),
                           keep_batches=True) as cap:
        for start in range(0, len(rows), per_step):
            batch = to({k: torch.cat([r[k] for r in rows[start:start + per_step]]) for k in rows[0]}, device)
            cap.annotate(ids=ids[start:start + per_step])
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
    for batch in cap.batches:
        flat = batch.flat().cpu()
        out.update({ident: flat[i] for i, ident in enumerate(batch.ids)})
    return out


def _ddp_rank(rank: int, world: int, backend: str, rendezvous: str, out: str) -> None:
    """One rank of check 7 (``torch.multiprocessing.spawn`` target): DDP capture of its half of the examples."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        model = gpt2(2).to(device)
        ddp = DDP(model, device_ids=[rank] if device.type == "cuda" else None)
        ids, rows = _ddp_data(model.config.vocab_size)
        share = slice(rank * DDP_EXAMPLES // world, (rank + 1) * DDP_EXAMPLES // world)
        torch.save(_ddp_rows(ddp, ids[share], rows[share], device, DDP_PER_STEP), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def check_ddp(ctx: Context) -> Iterator[Row]:
    import torch.multiprocessing as mp

    backend = ctx.ddp_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else ""
    if not backend:
        yield Row("7", "DDP, 2 ranks: rows vs 1 process", "-", f"<= {FP32_RTOL:g}", "skip",
                  f"needs 2 CUDA devices for NCCL (this machine has {torch.cuda.device_count()}); "
                  "--ddp-backend gloo runs the same check on 2 CPU processes")
        return
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise RuntimeError(f"--ddp-backend nccl needs 2 CUDA devices, found {torch.cuda.device_count()}")
    device = torch.device("cuda:0") if backend == "nccl" else torch.device("cpu")
    folder = Path(tempfile.mkdtemp(prefix="ddp-", dir=ctx.tmp))
    context = mp.spawn(_ddp_rank, args=(2, backend, str(folder / "rendezvous"), str(folder)), nprocs=2,
                       join=False)
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            raise TimeoutError("the 2 DDP ranks did not finish within 300 s (a hang)")
    model = gpt2(2).to(device)
    ids, rows = _ddp_data(model.config.vocab_size)
    reference = _ddp_rows(model, ids, rows, device, DDP_EXAMPLES)  # one process, one batch of all 8
    ranks = {}
    for r in range(2):
        ranks.update(torch.load(folder / f"rank{r}.pt"))
    assert sorted(ranks) == sorted(reference), (sorted(ranks), sorted(reference))
    err = max(rel_err(ranks[i], reference[i]) for i in reference)
    yield Row("7", "DDP, 2 ranks: rows vs 1 process", f"{err:.1e}", f"<= {FP32_RTOL:g} (max abs err / max abs ref)",
              verdict(err <= FP32_RTOL),
              f"{backend}{' on 2 CPU processes (the launch path, not NCCL)' if backend == 'gloo' else ''}: GPT-2 "
              f"h=32 L=2, {DDP_EXAMPLES} padded examples, {DDP_PER_STEP} per rank and step, LoGra rank 8, "
              "token-mean loss")


# ---------------------------------------------------------------------------------------------- 8. MoE experts
def _by_kind(report, names) -> dict[str, list[str]]:
    """The captured parameter names grouped as ``experts``, ``router`` and ``rest`` by their handler's kind."""
    kind_of = {param: kind for _, kind, params in report.layers for param in params}
    groups: dict[str, list[str]] = {"experts": [], "router": [], "rest": []}
    for name in names:
        kind = kind_of.get(name, "")
        groups["experts" if kind.startswith("experts(") else "router" if kind == "router" else "rest"].append(name)
    return groups


def _grouped_refusals() -> set:
    """The (device, dtype, shapes) keys for which gradtrace's experts products found ``grouped_mm`` refusing."""
    from gradtrace.capture.layers import experts_ops as moe

    return set(getattr(moe, "_NO_GROUPED", ()))


def _top_k(model, batch: dict[str, torch.Tensor], routers: list[str]) -> torch.Tensor:
    """``[routers, B, T, k]``: each router's chosen experts per token (sorted; -1 at padding), one forward pass."""
    chosen = []

    def keep(module, args, out) -> None:
        chosen.append(next(o for o in reversed(out) if not o.is_floating_point()).detach().sort(-1).values)

    handles = [model.get_submodule(name).register_forward_hook(keep) for name in routers]
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    shape = (*batch["input_ids"].shape, -1)
    return torch.stack([c.view(shape).masked_fill(batch["attention_mask"][..., None] == 0, -1) for c in chosen])


def _reads_forward(collect: Callable[[], Any]) -> str:
    """Runs ``collect()`` once and says whether the experts' hooks read the forward's values (h, z, and dh from
    autograd: ``gradtrace.capture.layers.experts_forward``) or recomputed them."""
    import importlib

    experts = importlib.import_module("gradtrace.capture.layers.experts")
    on_grad, calls = experts._Later.on_grad, []

    def counted(self, grad):
        calls.append(1)
        return on_grad(self, grad)

    experts._Later.on_grad = counted
    try:
        collect()
    finally:
        experts._Later.on_grad = on_grad
    return f"forward's values read in {len(calls)} experts calls" if calls else "experts' hidden values recomputed"


def _products_path(before: set) -> str:
    """Which path gradtrace's experts products took since ``before`` (the refusals then), as far as the record says."""
    new = _grouped_refusals() - before
    if new:
        return f"blocks where grouped_mm refused {', '.join(sorted(map(str, new)))}"
    return "grouped_mm available, no refusal recorded" if hasattr(F, "grouped_mm") else "blocks (no grouped_mm)"


def check_moe(ctx: Context) -> Iterator[Row]:
    dev = ctx.device
    vocab, hidden, layers, experts, top_k = (256, 32, 2, 6, 2) if ctx.quick else (1024, 128, 2, 8, 2)
    lengths = [12, 16, 7, 10] if ctx.quick else [48, 64, 17, 33, 64, 25, 40, 9]
    rows, batch = padded_batch(lengths, vocab, seed=6)
    batch = to(batch, dev)
    refused = _grouped_refusals()
    model32 = qwen3_moe(vocab, hidden, layers, experts, top_k).to(dev)
    model32.train()
    setup = (f"Qwen3-MoE h={hidden} L={layers} V={vocab}, {experts} experts top-{top_k}, experts implementation "
             f"{model32.config._experts_implementation!r}, batch {len(lengths)} ragged to {max(lengths)} tokens, "
             f"on {dev}")
    cap = capture_step(model32, batch, None)
    got = cap.batches[0].per_example_grads()
    ref = brute_force(model32, rows, dev)
    groups = _by_kind(cap.report(), ref)
    assert groups["experts"] and groups["router"], groups
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = {g: max(names, key=errs.get) for g, names in groups.items()}
    top = max(errs.values())
    path = _products_path(refused)
    yield Row("8a", "MoE exact capture vs brute force, float32", f"{top:.1e}",
              f"<= {FP32_RTOL:g} (max abs err / max abs ref, worst parameter)", verdict(top <= FP32_RTOL),
              f"{setup}; worst per group: " + ", ".join(f"{g} {errs[n]:.1e} ({n})" for g, n in worst.items())
              + f"; gradtrace's experts products: {path}")

    logra = gradtrace.LoGra(rank=8, seed=0)
    rows32 = captured(model32, batch, logra).flat()  # [E, D]
    model16 = qwen3_moe(vocab, hidden, layers, experts, top_k).to(dev, torch.bfloat16)
    model16.load_state_dict(model32.state_dict())
    model16.train()
    batch16 = captured(model16, batch, logra)
    rows16 = batch16.flat()
    cos32 = F.cosine_similarity(rows16.float(), rows32.float(), dim=1)  # [E]
    experts_dims = sum(batch16.params[n].flat().shape[1] for n in groups["experts"])
    # a token whose top-k differs in bf16 takes other experts: a jump, not round-off; such rows are reported apart
    routers = [module for module, kind, _ in cap.report().layers if kind == "router"]
    flips = (_top_k(model32, batch, routers) != _top_k(model16, batch, routers)).any(-1).sum((0, 2))  # [E]
    same = flips == 0
    note = (f"LoGra rank 8, {rows32.shape[1]} dims ({experts_dims} of the experts, each expert's block projected), "
            f"routers included; the same weights cast to bf16; {int(same.sum())} of {len(same)} rows route every "
            f"token alike in bf16 (the bound's rows); the others ({', '.join(map(str, flips[~same].tolist())) or '-'}"
            f" token(s) routed differently) are at min cos {float(cos32[~same].min()) if (~same).any() else 1:.5f}")
    if not bool(same.any()):
        yield Row("8b", "MoE bf16 LoGra rows vs float32 rows", "-", f">= {BF16_COSINE} per row", "skip",
                  f"every row has a token routed differently in bf16: nothing to hold to round-off; {note}")
    else:
        low = float(cos32[same].min())
        yield Row("8b", "MoE bf16 LoGra rows vs float32 rows", f"min cos {low:.5f}",
                  f">= {BF16_COSINE} per row (rows routed alike)", verdict(low >= BF16_COSINE), note)
    del model16, ref, got
    yield from _moe_timing(ctx)


def _moe_timing(ctx: Context) -> Iterator[Row]:
    """8c: LoGra collection (rank 16, in memory) of a fused-experts model against a training pass of it."""
    dev = ctx.device
    if ctx.cuda:  # full: bench/moe_capture.py's workload (Qwen3-MoE 4x256, 16 experts top-4, V 8,192, 64 x 128)
        vocab, hidden, layers, experts, top_k, rows, length, dtype = \
            (8192, 256, 2, 16, 4, 32, 128, torch.bfloat16) if ctx.quick else (8192, 256, 4, 16, 4, 64, 128,
                                                                               torch.bfloat16)
    else:
        vocab, hidden, layers, experts, top_k, rows, length, dtype = \
            (512, 64, 2, 8, 2, 16, 64, torch.float32) if ctx.quick else (8192, 256, 4, 16, 4, 64, 128, torch.float32)
    per_batch = 8
    model = qwen3_moe(vocab, hidden, layers, experts, top_k).to(dev, dtype)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, vocab, (rows, length), generator=gen)  # [N, T]
    batches = [{"id": [f"t{j}" for j in range(i, i + per_batch)], "input_ids": tokens[i:i + per_batch]}
               for i in range(0, rows, per_batch)]
    on_device = [to({"input_ids": b["input_ids"], "labels": b["input_ids"]}, dev) for b in batches]
    options = CaptureOptions(projection=gradtrace.LoGra(rank=16))

    train, collect = train_and_collect(model, batches, on_device, options, dev)

    model.train()
    train()  # warm-up
    refused = _grouped_refusals()
    read = _reads_forward(collect)
    path = f"{_products_path(refused)}; {read}"
    best = {"train": float("inf"), "collect": float("inf")}
    for _ in range(2):  # alternate, best of two
        model.train()
        best["train"] = min(best["train"], timed(train, dev))
        best["collect"] = min(best["collect"], timed(collect, dev))
    ratio = best["collect"] / best["train"]
    setup = (f"{str(dtype).removeprefix('torch.')} Qwen3-MoE h={hidden} L={layers} V={vocab:,}, {experts} experts "
             f"top-{top_k}, {rows} x {length} tokens in batches of {per_batch}, LoGra rank 16 in memory, every "
             f"parameter; training pass: forward + backward, no optimizer; best of 2 after warm-up, on {dev}; "
             f"gradtrace's experts products: {path}")
    if ctx.cuda:
        yield Row("8c", "MoE time: collect / training pass", f"{ratio:.2f}x ({best['collect']:.3f} / "
                  f"{best['train']:.3f} s)", f"<= {MOE_TARGET}x (issue #31's target)", verdict(ratio <= MOE_TARGET),
                  setup)
    else:
        yield Row("8c", "MoE time: collect / training pass", f"{ratio:.2f}x ({best['collect']:.3f} / "
                  f"{best['train']:.3f} s)", f"<= {MOE_TARGET}x on CUDA", "skip",
                  f"{setup}; the target is the device's (the CPU's: bench/moe_capture.py, at full size and with "
                  "a store); at --quick shapes a CPU time is mostly per-call overhead")


# ---------------------------------------------------------------------------------------------- 9. attention sinks
def check_sinks(ctx: Context) -> Iterator[Row]:
    from gradtrace.capture.coverage import recorded_coverage

    dev = ctx.device
    vocab, hidden, layers = (256, 32, 2) if ctx.quick else (1024, 64, 4)
    lengths = [12, 16, 7, 10] if ctx.quick else [48, 64, 17, 33, 64, 25, 40, 9]
    rows, batch = padded_batch(lengths, vocab, seed=7)
    model = gpt_oss(vocab, hidden, layers).to(dev)
    model.train()
    setup = (f"gpt-oss h={hidden} L={layers} V={vocab}, eager attention, {len(SINKS)} heads with sinks, sliding "
             f"window 8 on alternate layers, batch {len(lengths)} ragged to {max(lengths)} tokens, on {dev}")
    cap = capture_step(model, to(batch, dev), None)
    got = cap.batches[0].per_example_grads()
    ref = brute_force(model, rows, dev)
    sinks = [n for n in ref if n.endswith("sinks")]
    assert len(sinks) == layers, sinks
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(sinks, key=errs.get)
    rest = max((n for n in ref if n not in sinks), key=errs.get)
    yield Row("9a", "gpt-oss sinks exact vs brute force, float32", f"{errs[worst]:.1e}",
              f"<= {FP32_RTOL:g} (max abs err / max abs ref, worst sinks)", verdict(errs[worst] <= FP32_RTOL),
              f"{setup}; worst: {worst}; every other parameter: worst {errs[rest]:.1e} ({rest})")

    coverage = cap.coverage()
    kinds = sorted({kind for _, kind, _ in cap.report().layers})
    store = _collect(model, id_batches(8, 24, vocab, per_batch=4, seed=8), dev, ctx.tmp / "sinks")
    stored = recorded_coverage(store.manifest)
    ok = (coverage.share == 1.0 and not coverage.uncovered and stored is not None and stored.share == 1.0
          and "attention-sinks" in kinds)
    yield Row("9b", "gpt-oss coverage: capture and collect's store",
              f"capture {coverage.percent}, store {stored.percent if stored is not None else 'not recorded'}",
              "100% of the trainable parameters per example", verdict(ok),
              f"capture of 9a ({coverage.captured:,} of {coverage.trainable:,} elements) and gradtrace.collect of 8 "
              f"examples into a float32 store (LoGra rank 8), on {dev}; handler kinds: {', '.join(kinds)}")


# ---------------------------------------------------------------------------------------------- 10. metagradients
def _lm_losses(forward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example mean next-token loss ``[B]`` in the model's dtype (unpadded rows of one length)."""
    logits = forward(input_ids=batch["input_ids"]).logits[:, :-1]  # [B, T-1, V]
    targets = batch["input_ids"][:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def _query_loss(forward, query: dict[str, torch.Tensor]) -> torch.Tensor:
    return _lm_losses(forward, query).mean()


def _in_float64(run):
    """A recorded run's floating tensors (and the manifest's record of them) in float64, in memory, as
    ``gradtrace metagrad --dtype float64`` replays a float32 run."""
    import copy

    def convert(tensors):
        return {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}

    run.initial = convert(run.initial)
    run.final = convert(run.final) if run.final is not None else None
    run.manifest = copy.deepcopy(run.manifest)
    for info in run.manifest["params"].values():
        info["dtype"] = "float64" if info["dtype"] in ("float16", "bfloat16", "float32") else info["dtype"]
    return run


def check_metagrad(ctx: Context) -> Iterator[Row]:
    import copy
    import math

    from gradtrace.options import MetagradOptions
    from gradtrace.replay import RunRecorder, load_run, metagradients, replay
    from gradtrace.replay.replay import DEFAULT_TOLERANCE

    dev = ctx.device
    vocab, hidden, layers, examples, length, per_step, epochs = \
        (64, 16, 1, 8, 8, 4, 2) if ctx.quick else (256, 64, 2, 32, 32, 8, 3)
    gen = torch.Generator().manual_seed(10)
    tokens = torch.randint(3, vocab, (examples + 3, length), generator=gen)  # [N + Q, T]: training rows, queries
    order = [torch.randperm(examples, generator=gen).tolist() for _ in range(epochs)]
    steps = [epoch[s:s + per_step] for epoch in order for s in range(0, examples, per_step)]
    queries = [{"input_ids": tokens[examples + q:examples + q + 1]} for q in range(3)]
    base = llama(vocab, hidden, layers, heads=4, kv_heads=2, seed=3)
    base.set_attn_implementation("eager")  # differentiated twice: not every SDPA kernel has a double backward
    base.train()

    def batches_on(device: torch.device) -> Callable[[list], dict[str, torch.Tensor]]:
        return lambda ids: {"input_ids": tokens[ids].to(device)}

    def train(model, record: Path | None) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
        rec = RunRecorder(record, model, opt, grad_clip=1.0) if record is not None else None
        batches = batches_on(dev)
        for ids in steps:
            _lm_losses(model, batches(ids)).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rec is not None:
                rec.step(ids)
        if rec is not None:
            rec.finish(model)

    run_dir = ctx.tmp / "metagrad-run"
    train(copy.deepcopy(base).to(dev), run_dir)
    fresh = copy.deepcopy(base).to(dev)
    train_s = timed(lambda: train(fresh, None), dev)  # after the recorded run: warm
    setup = (f"Llama h={hidden} L={layers} V={vocab}, eager attention, float32, {examples} examples of {length} "
             f"tokens, {len(steps)} SGD steps (momentum 0.9, weight decay 0.01, clipping 1.0, foreach=False) of "
             f"{per_step}, recorded on {dev}")
    run = load_run(run_dir)
    model = copy.deepcopy(base).to(dev)
    difference = replay(run, model, _lm_losses, batches_on(dev), tolerance=math.inf).difference
    bound = DEFAULT_TOLERANCE[torch.float32]
    yield Row("10a", "replay difference on the device, float32", f"{difference:.1e}" if difference else "0 (bit-exact)",
              f"<= {bound:g} (the replay's float32 default; 0 where the kernels are deterministic)",
              verdict(difference <= bound),
              f"{setup}; max |theta - theta_rec| / max(1, max |theta_rec|) over the parameters")

    start = time.perf_counter()
    got = metagradients(run, model, _lm_losses, batches_on(dev), [{k: v.to(dev) for k, v in q.items()}
                                                                  for q in queries],
                        _query_loss, train_ids=list(range(examples)))
    sync(dev)
    meta_s = time.perf_counter() - start
    run64 = _in_float64(load_run(run_dir))
    ref = metagradients(run64, copy.deepcopy(base).double(), _lm_losses, batches_on(torch.device("cpu")), queries,
                        _query_loss, train_ids=list(range(examples)),
                        options=MetagradOptions(tolerance=bound))  # the float32 run's bound: the coarser precision
    err = rel_err(got.scores, ref.scores)
    yield Row("10b", "metagradients: device float32 vs CPU float64", f"{err:.1e}",
              f"<= {META_RTOL:g} (max abs err / max abs ref)", verdict(err <= META_RTOL),
              f"3 queries x {examples} examples; the reference replays the recorded run in float64 on the CPU (its "
              f"replay difference {ref.replay_difference:.1e}: the float32 run's round-off); float32 round-off "
              f"carried through {len(steps)} steps of Hessian-vector products")
    yield Row("10c", "time: metagradients / training run", f"{meta_s / train_s:.1f}x ({meta_s:.2f} / {train_s:.2f} s)",
              "none (informative)", "pass",
              f"3 queries in one vectorised reverse pass, checkpoints every {got.checkpoint_every} steps; training: "
              f"the same {len(steps)} steps without the recorder, on {dev}")


CHECKS: dict[str, Callable[[Context], Iterator[Row]]] = {
    "1": check_exactness, "2": check_host_syncs, "3": check_memory, "4": check_int8, "5": check_scores,
    "6": check_throughput, "7": check_ddp, "8": check_moe, "9": check_sinks, "10": check_metagrad,
}


# ---------------------------------------------------------------------------------------------- running, output
def run_checks(ctx: Context, checks: dict[str, Callable[[Context], Iterator[Row]]],
               echo: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Every check's rows; an exception becomes an ``error`` row of its check and the next check runs."""
    out: list[Row] = []
    for key, check in checks.items():
        start = time.perf_counter()
        try:
            for row in check(ctx):
                row.seconds = time.perf_counter() - start
                out.append(row)
                echo(row)
                start = time.perf_counter()
        except Exception as err:  # isolation: report it and go on
            last = traceback.extract_tb(err.__traceback__)[-1]
            row = Row(key, check.__name__.removeprefix("check_"), "-", "-", "error",
                      f"{type(err).__name__}: {err} ({Path(last.filename).name}:{last.lineno})".replace("\n", " "),
                      time.perf_counter() - start)
            out.append(row)
            echo(row)
        finally:
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()
    return out


def environment(ctx: Context, argv: list[str]) -> list[str]:
    import transformers

    lines = [f"command: `{shlex.join(['python', 'bench/gpu_check.py', *argv])}`",
             f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__},"
             f" gradtrace {gradtrace.__version__}, {platform.machine()} ({os.cpu_count()} CPUs)"]
    if ctx.cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"device: {ctx.device} ({names}), CUDA {torch.version.cuda}; TF32 matmul "
                     f"{torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}")
    else:
        lines.append("device: cpu -- not a GPU run: the CUDA-only checks are skipped")
    return lines


def table(rows: list[Row]) -> str:
    head = "| check | what | value | bound | status | s | notes |\n|---|---|---|---|---|---|---|\n"
    cells = [(r.check, r.name, r.value, r.bound, f"**{r.status}**" if r.status in ("fail", "error") else r.status,
              f"{r.seconds:.1f}", r.notes) for r in rows]
    return head + "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in cell) + " |" for cell in cells)


def write_markdown(path: Path, block: str) -> None:
    """``block`` between the file's markers, each on a line of its own (the rest kept; a marker quoted in a
    sentence is text), appended to a file without them, or a page of its own."""
    text = path.read_text() if path.exists() else ""
    markers = re.search(f"^{re.escape(BEGIN)}$.*?^{re.escape(END)}$", text, flags=re.M | re.S)
    if markers is not None:
        text = text[:markers.start()] + f"{BEGIN}\n{block}\n{END}" + text[markers.end():]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "# GPU checks (bench/gpu_check.py)\n\n") + \
            f"{BEGIN}\n{block}\n{END}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, cuda:N or cpu (default: cuda when there is one)")
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (the CPU test runs this)")
    parser.add_argument("--only", help="comma-separated check numbers (default: all)")
    parser.add_argument("--ddp-backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="check 7: auto = NCCL when there are 2 CUDA devices, else skipped; gloo = 2 CPU processes")
    parser.add_argument("--self-compare", action="store_true", help=argparse.SUPPRESS)  # 4b and 5 on a CPU device
    args = parser.parse_args(argv)
    # read when cuBLAS makes its first handle; torch.use_deterministic_algorithms needs it (check 4's second run)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 bounds assume float32 products
        torch.backends.cudnn.allow_tf32 = False
    checks = CHECKS if not args.only else {k: CHECKS[k] for k in args.only.split(",")}
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*use_cache=True.*")
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable. is deprecated.*")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Context(device=device, quick=args.quick, tmp=Path(tmp), ddp_backend=args.ddp_backend,
                      self_compare=args.self_compare)
        header = environment(ctx, argv)
        print("\n".join(header), flush=True)
        print(f"{'check':<6} {'status':<6} {'value':<44} bound", flush=True)

        def echo(row: Row) -> None:
            print(f"{row.check:<6} {row.status:<6} {row.value:<44} {row.bound}  [{row.seconds:.1f} s] {row.notes}",
                  flush=True)

        rows = run_checks(ctx, checks, echo)
    block = "\n".join(f"- {line}" for line in header) + "\n\n" + table(rows)
    print("\n" + table(rows))
    if args.out is not None:
        write_markdown(args.out, block)
        print(f"\nwritten: {args.out}")
    bad = [r.check for r in rows if r.status in ("fail", "error")]
    print(f"\n{len(rows)} rows: " + ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in STATUSES)
          + (f"; failing: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
