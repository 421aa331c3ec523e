"""What each rank runs in the distributed tests (``fn(rank, world_size, ...)``, see ``launch.run_ranks``), and the
models, data and single-process references they are compared with.

Everything is deterministic: models are built from a fixed seed, every rank takes a fixed slice of fixed
examples, and no optimizer step changes the weights between backward passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.options import CaptureOptions, Loss, StoreOptions
from gradtrace.store import GradientStore, StoreWriter, model_fingerprint
from tests import tiny

NUM_EXAMPLES = 8
BATCH = 2
SEQ = 10
LOGRA = dict(rank=4, seed=7)
IDS = [f"ex{i}" for i in range(NUM_EXAMPLES)]


# ---------------------------------------------------------------------------------------------- models and data
class FunctionalHead(nn.Module):
    """An MLP whose head is applied functionally (``F.linear``): its forward hook never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(7, 12)
        self.head = nn.Linear(12, 4)

    def forward(self, x):
        return F.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return tiny.gpt2()
    if kind == "llama":
        return tiny.llama()
    if kind == "functional":
        return FunctionalHead()
    if kind == "moe":
        from tests.capture.test_experts import qwen3_moe

        return qwen3_moe()  # fused experts and routers
    return tiny.MLP()


def is_lm(kind: str) -> bool:
    return kind in ("gpt2", "llama", "moe")


def dataset(kind: str) -> dict[str, torch.Tensor]:
    """All examples: token rows with right padding (ragged lengths) for LMs, features and classes otherwise."""
    gen = torch.Generator().manual_seed(1)
    if is_lm(kind):
        lengths = [10, 7, 9, 4, 10, 6, 8, 5]
        ids = torch.randint(3, tiny.VOCAB, (NUM_EXAMPLES, SEQ), generator=gen)
        mask = (torch.arange(SEQ).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
        ids = ids.masked_fill(mask == 0, 0)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return {"x": torch.randn(NUM_EXAMPLES, 7, generator=gen), "y": torch.randint(0, 4, (NUM_EXAMPLES,), generator=gen)}


def rows_of(rank: int, world: int) -> list[int]:
    """The examples rank ``rank`` trains on: a contiguous share (rank 0 the first half)."""
    per = NUM_EXAMPLES // world
    return list(range(rank * per, (rank + 1) * per))


def rank_batches(kind: str, rank: int, world: int) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    data, rows = dataset(kind), rows_of(rank, world)
    out = []
    for start in range(0, len(rows), BATCH):
        take = rows[start:start + BATCH]
        out.append(([IDS[i] for i in take], {k: v[take] for k, v in data.items()}))
    return out


def loss_of(kind: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if is_lm(kind):
        return model(**batch).loss  # the token mean over the call's target tokens
    return F.cross_entropy(model(batch["x"]), batch["y"])


def capture_options(kind: str, logra: bool, **capture: Any) -> dict[str, Any]:
    """The ``loss`` and ``options`` keywords of ``gradtrace.capture`` for a job's loop."""
    return {"loss": gradtrace.Loss(reduction="token_mean" if is_lm(kind) else "mean"),
            "options": gradtrace.CaptureOptions(projection=gradtrace.LoGra(**LOGRA) if logra else None, **capture)}


def per_example(batches: list, logra: bool) -> dict[str, Any]:
    """``{id: {param: grad}}`` (exact) or ``{id: vector}`` (LoGra) from captured batches."""
    out: dict[str, Any] = {}
    for batch in batches:
        if logra:
            flat = batch.flat()
            out.update({ident: flat[i] for i, ident in enumerate(batch.ids)})
        else:
            grads = batch.per_example_grads()
            out.update({ident: {n: g[i] for n, g in grads.items()} for i, ident in enumerate(batch.ids)})
    return out


def single_process(kind: str, logra: bool) -> dict[str, Any]:
    """The reference: one process captures all examples in one batch."""
    model = build(kind)
    data = dataset(kind)
    with gradtrace.capture(model, **capture_options(kind, logra), keep_batches=True) as cap:
        cap.annotate(ids=IDS)
        loss_of(kind, model, data).backward()
    return per_example(cap.batches, logra)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's ``.grad`` (the local shard under FSDP2), cloned."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        out[name] = None if grad is None else grad.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] is None and b[k] is None) or
                                        (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k]))
                                        for k in a)


# ---------------------------------------------------------------------------------------------- DDP
def ddp_capture(rank: int, world: int, kind: str, store_root: str) -> dict[str, Any]:
    """Capture under DDP in three ways (hooks before wrapping, on the wrapper, on the inner module after
    wrapping), exact and LoGra; compare ``param.grad`` with an uncaptured DDP run; one run also writes a store."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = rank_batches(kind, rank, world)
    plain = DDP(build(kind))
    reference = []
    for _, batch in batches:
        loss_of(kind, plain, batch).backward()
        reference.append(_grads(plain.module))
        plain.zero_grad(set_to_none=True)

    results = {}
    for mode in ("before", "wrapper", "inner"):
        for logra in (False, True):
            model = build(kind)
            seen: list[dict] = []
            callbacks: list[Any] = [lambda batch, model=model, seen=seen: seen.append(_grads(model))]
            if mode == "wrapper" and logra:
                callbacks.append(StoreWriter(store_root, StoreOptions(shard_rows=3)))
            options = dict(capture_options(kind, logra, verify=True), callbacks=callbacks, keep_batches=True)
            grads_unchanged = callbacks_see_final = True
            with contextlib.ExitStack() as stack:
                if mode == "before":
                    cap = stack.enter_context(gradtrace.capture(model, **options))
                    ddp = DDP(model)
                else:
                    ddp = DDP(model)
                    cap = stack.enter_context(gradtrace.capture(ddp if mode == "wrapper" else model, **options))
                for step, (ids, batch) in enumerate(batches):
                    cap.annotate(ids=ids)
                    loss_of(kind, ddp, batch).backward()
                    after = _grads(model)
                    grads_unchanged &= _same(after, reference[step])
                    callbacks_see_final &= _same(seen[-1], after)
                    model.zero_grad(set_to_none=True)
            results[mode, logra] = {"grads": per_example(cap.batches, logra), "grads_unchanged": grads_unchanged,
                                    "callbacks_see_final": callbacks_see_final, "ok": cap.report().ok}
    return results


# ---------------------------------------------------------------------------------------------- FSDP2
def _shard(model: nn.Module, kind: str, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    if kind == "gpt2":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
    elif kind in ("llama", "moe"):
        for layer in model.model.layers:
            fully_shard(layer.input_layernorm, mesh=mesh)  # a probed HF RMSNorm that is an FSDP module itself
            fully_shard(layer, mesh=mesh)
    else:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_capture(rank: int, world: int, kind: str, store_root: str) -> dict[str, Any]:
    """Capture under FSDP2 with hooks installed before and after ``fully_shard``, exact and LoGra; compare the
    sharded ``param.grad`` with an uncaptured FSDP2 run; fingerprint; one run also writes a store."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batches = rank_batches(kind, rank, world)
    plain = build(kind)
    _shard(plain, kind, mesh)
    reference = []
    for _, batch in batches:
        loss_of(kind, plain, batch).backward()
        reference.append(_grads(plain))
        plain.zero_grad(set_to_none=True)

    results: dict[Any, Any] = {"fingerprint": model_fingerprint(plain)}
    for mode in ("before", "after"):
        for logra in (False, True):
            model = build(kind)
            seen: list[dict] = []
            callbacks: list[Any] = [lambda batch, model=model, seen=seen: seen.append(_grads(model))]
            if mode == "after" and logra:
                callbacks.append(StoreWriter(store_root, StoreOptions(shard_rows=3)))
            options = dict(capture_options(kind, logra, verify=True), callbacks=callbacks, keep_batches=True)
            grads_unchanged = callbacks_see_final = True
            with contextlib.ExitStack() as stack:
                if mode == "before":
                    cap = stack.enter_context(gradtrace.capture(model, **options))
                    _shard(model, kind, mesh)
                else:
                    _shard(model, kind, mesh)
                    cap = stack.enter_context(gradtrace.capture(model, **options))
                for step, (ids, batch) in enumerate(batches):
                    cap.annotate(ids=ids)
                    loss_of(kind, model, batch).backward()
                    after = _grads(model)
                    grads_unchanged &= _same(after, reference[step])
                    callbacks_see_final &= _same(seen[-1], after)
                    model.zero_grad(set_to_none=True)
            results[mode, logra] = {"grads": per_example(cap.batches, logra), "grads_unchanged": grads_unchanged,
                                    "callbacks_see_final": callbacks_see_final, "ok": cap.report().ok,
                                    "report": str(cap.report())}
    return results


def fsdp_functional(rank: int, world: int) -> dict[str, Any]:
    """A parameter used functionally is reported under FSDP2 as in one process (the parameter hooks fire on the
    unsharded parameters); FSDP1 is refused with a clear error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    model = build("functional")
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradtrace.capture(model, options=CaptureOptions(partial=True)) as cap:  # allowed: reported
            model(x).sum().backward()
    messages = [str(w.message) for w in caught if "gradtrace" in str(w.message)]
    try:  # the default: an error at that backward pass, on every rank
        with gradtrace.capture(model):
            model(x).sum().backward()
        error = None
    except ValueError as err:
        error = str(err)

    fsdp1 = FullyShardedDataParallel(build("mlp"), device_id=torch.device("cpu"), use_orig_params=True)
    try:
        gradtrace.capture(fsdp1)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"warnings": messages, "functional": list(cap.report().functional), "fsdp1": refused, "error": error}


# ---------------------------------------------------------------------------------------------- sharded scoring
def sharded_scores(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Score every case with ``score_sharded``; return the Scores (or the error each case raised)."""
    from gradtrace.distributed import score_sharded

    out = []
    for case in cases:
        train = [GradientStore.open(p) for p in case["train"]]
        queries = [GradientStore.open(p) for p in case["queries"]]
        per_rank = case.get("queries_of_rank")
        if per_rank is not None:  # a bad input: this rank scores other queries
            queries = [GradientStore.open(per_rank[rank])]
        if case.get("fail_on_rank") == rank:  # a bad input: this rank cannot read its rows

            def fail(*args, **kwargs):
                raise OSError("disk read error (test)")

            train[0].read = fail
        method_options = case.get("method_options", {})
        attributor = gradtrace.Attributor(case["method"], train if len(train) > 1 else train[0],
                                          block_rows=case.get("block_rows", 8192),
                                          matrix_bytes=case.get("matrix_bytes", 2**30), **method_options)
        try:
            scores = score_sharded(attributor, queries if len(queries) > 1 else queries[0], topk=case["topk"],
                                   matrix=case.get("matrix", "auto"), split=case.get("split", "balanced"))
            out.append(scores)
        except Exception as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


# ---------------------------------------------------------------------------------------------- bad input
def disagreeing_ranks(rank: int, world: int, store_root: str, what: str) -> dict[str, Any]:
    """Ranks that capture different layers / projections (or whose store another run holds) into one store:
    the capture must fail at its start on every rank, and leave no hook behind."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build("mlp")
    ddp = DDP(model)
    options: dict[str, Any] = {"projection": gradtrace.LoGra(**LOGRA)}
    if what == "layers" and rank == 1:
        options["exclude"] = ["net.6"]
    if what == "projection" and rank == 1:
        options["projection"] = gradtrace.LoGra(rank=4, seed=8)
    start = time.monotonic()
    try:
        with gradtrace.capture(ddp, options=gradtrace.CaptureOptions(**options), callbacks=[StoreWriter(store_root)]):
            _, batch = rank_batches("mlp", rank, world)[0]
            loss_of("mlp", ddp, batch).backward()
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    dist.barrier()  # both ranks are still in step: nothing hangs
    return {"error": error, "seconds": time.monotonic() - start, "hooks_left": hooks}


def _wait_rows(writer_cb: StoreWriter, rows: int, limit: float = 20) -> None:
    deadline = time.monotonic() + limit
    while (writer_cb.writer is None or writer_cb.writer.rows_written < rows) and time.monotonic() < deadline:
        time.sleep(0.005)


def dying_rank(rank: int, world: int, store_root: str, resume: bool) -> dict[str, Any]:
    """DDP capture into a store; without ``resume``, rank 1 is SIGKILLed once its first shard is committed (a
    crash) and rank 0 sees the failure in its next collective. With ``resume``, the run completes the store."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build("mlp")
    ddp = DDP(model)
    writer = StoreWriter(store_root, StoreOptions(shard_rows=2, resume=resume))
    error = None
    try:
        with gradtrace.capture(ddp, callbacks=[writer], **capture_options("mlp", True)) as cap:
            for step, (ids, batch) in enumerate(rank_batches("mlp", rank, world)):
                cap.annotate(ids=ids)
                loss_of("mlp", ddp, batch).backward()
                model.zero_grad(set_to_none=True)
                if not resume and rank == 1 and step == 0:
                    _wait_rows(writer, BATCH)
                    os.kill(os.getpid(), signal.SIGKILL)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    return {"error": error}


def holding_run(rank: int, world: int, store_root: str, signals: str) -> dict[str, Any]:
    """A run that opens its store writers, says so (``ready-<rank>``), and finishes only after ``go`` exists."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build("mlp")
    ddp = DDP(model)
    writer = StoreWriter(store_root, StoreOptions(shard_rows=2))
    batches = rank_batches("mlp", rank, world)
    with gradtrace.capture(ddp, callbacks=[writer], **capture_options("mlp", True)) as cap:
        for step, (ids, batch) in enumerate(batches):
            cap.annotate(ids=ids)
            loss_of("mlp", ddp, batch).backward()
            model.zero_grad(set_to_none=True)
            if step == 0:
                Path(signals, f"ready-{rank}").touch()
                deadline = time.monotonic() + 40
                while not Path(signals, "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
    return {"rows": writer.writer.rows_written}


def collect_store(rank: int, world: int, store_root: str, overwrite: bool = False) -> dict[str, Any]:
    """``gradtrace.collect(..., store=...)`` on every rank over its own (uneven) share of the examples: the ranks
    write one store, which every rank can open as soon as ``collect`` returns. With ``overwrite``, rank 0 starts
    late, so that rank 1's writer is open before rank 0 could replace the old store."""
    if overwrite and rank == 0:
        time.sleep(1.0)
    model = build("gpt2")
    data = dataset("gpt2")
    share = [0, 1] if rank == 0 else [2, 3, 4, 5, 6, 7]  # rank 0 finishes first
    batches = [{"id": [IDS[i] for i in share[k:k + BATCH]], **{key: v[share[k:k + BATCH]] for key, v in data.items()
                                                             if key != "labels"}}
               for k in range(0, len(share), BATCH)]
    store = gradtrace.collect(model, batches, store=store_root,
                              options=CaptureOptions(projection=gradtrace.LoGra(**LOGRA)),
                              store_options=StoreOptions(shard_rows=3, overwrite=overwrite))
    return {"ids": sorted(store.ids), "complete": store.complete}


# ---------------------------------------------------------------------------------------------- online selection
def selection_target() -> torch.Tensor:
    model = build("mlp")
    gen = torch.Generator().manual_seed(7)
    return torch.randn(sum(p.numel() for p in model.parameters()), generator=gen)


def ddp_selection(rank: int, world: int, renormalize: bool) -> dict[str, Any]:
    """Each rank trains on its half under DDP; selection drops examples against a fixed target on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    from gradtrace.options.train import SelectionOptions
    from gradtrace.train import OnlineSelection

    model = DistributedDataParallel(build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, target=selection_target(), options=SelectionOptions(renormalize=renormalize))
    data, rows = dataset("mlp"), rows_of(rank, world)
    with gradtrace.capture(model, loss=Loss(reduction="mean"), callbacks=[selector]) as cap:
        cap.annotate(ids=[IDS[i] for i in rows])
        F.cross_entropy(model(data["x"][rows]), data["y"][rows]).backward()
        opt.step()
    return {"dropped": selector.history[-1].dropped,
            "grads": {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()}}
