"""Cost of metagradients (gradtrace.replay) against the training run they differentiate (issue #32, item 6).

Workload: an MLP (``--dim`` inputs, one tanh hidden layer of ``--hidden``, 10 classes), ``--examples`` random
examples, batch ``--batch``, AdamW with a warmup + cosine schedule and clipping at 1.0, ``--steps`` optimizer steps
(epochs repeat the examples), fp32 on the CPU. Phases, each in a fresh subprocess so that its peak resident
memory is its own (``ru_maxrss`` at the end minus after set-up; torch's CPU allocations are invisible to
tracemalloc): ``train_plain`` (the torch.optim loop alone), ``train`` (the same loop recorded by a
RunRecorder), ``replay`` (functional replay + check), ``metagrad`` with Q queries vectorised (one vmapped reverse
pass), ``metagrad_q1`` (one query), ``metagrad_loop`` (Q queries one at a time, ``query_batch=1``), and checkpoint
intervals 1 and T (``metagrad@k``; the default is sqrt(T)). First calls are warmed up before the clock; of
``--rounds`` runs of each phase the one of least CPU time is kept (wall and CPU seconds are printed: CPU time is
the steadier on a shared machine). Usage::

    python bench/metagrad_cost.py [--steps 100] [--queries 8] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _setup(args: argparse.Namespace):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 10))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.examples, args.dim, generator=gen), torch.randint(0, 10, (args.examples,), generator=gen)
    per_epoch = args.examples // args.batch
    steps = []
    while len(steps) < args.steps:
        order = torch.randperm(args.examples, generator=gen)
        steps += [order[i * args.batch:(i + 1) * args.batch].tolist() for i in range(per_epoch)]
    return model, x, y, steps[: args.steps]


def loss_fn(forward, batch):
    return F.cross_entropy(forward(batch[0]), batch[1], reduction="none")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _train(args, model, x, y, steps, run_dir):
    from transformers import get_cosine_schedule_with_warmup

    from gradtrace.replay import RunRecorder

    if run_dir is not None and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, 10, len(steps))
    rec = RunRecorder(run_dir, model, opt, scheduler=sched, grad_clip=1.0) if run_dir is not None else None
    for ids in steps:
        loss_fn(model, (x[ids], y[ids])).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rec is not None:
            rec.step(ids)
    if rec is not None:
        rec.finish(model)


def _warm(args: argparse.Namespace) -> None:
    """First calls (torch.optim's lazy imports, functional_call, batched double backward) before the clock."""
    from gradtrace.replay import load_run  # noqa: F401

    torch.set_num_threads(args.threads)
    net = torch.nn.Linear(3, 2)
    for opt in (torch.optim.AdamW(net.parameters()), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)):
        net(torch.randn(4, 3)).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().requires_grad_() for k, v in net.named_parameters()}
    out = torch.func.functional_call(net, params, (torch.randn(4, 3),)).square().sum()
    grads = torch.autograd.grad(out, list(params.values()), create_graph=True)
    torch.autograd.grad(grads, list(params.values()), [torch.ones(2, *g.shape) for g in grads],
                        is_grads_batched=True)


def _phase(name: str, args: argparse.Namespace, run_dir: str, queue) -> None:
    from gradtrace.options import MetagradOptions
    from gradtrace.replay import load_run, metagradients, replay

    if name.startswith("train"):
        from transformers import get_cosine_schedule_with_warmup  # noqa: F401  (imported before the clock)
    model, x, y, steps = _setup(args)
    batches = lambda ids: (x[ids], y[ids])
    gen = torch.Generator().manual_seed(2)
    queries = [(torch.randn(1, args.dim, generator=gen), torch.randint(0, 10, (1,), generator=gen))
               for _ in range(args.queries)]
    query_loss = lambda forward, q: F.cross_entropy(forward(q[0]), q[1])
    _warm(args)
    base = _rss_mib()
    start, cpu = time.perf_counter(), time.process_time()
    if name == "train_plain":
        _train(args, model, x, y, steps, None)
    elif name == "train":
        _train(args, model, x, y, steps, Path(run_dir))
    else:
        run = load_run(run_dir)
        if name == "replay":
            replay(run, model, loss_fn, batches)
        else:
            kind, _, every = name.partition("@")
            count = 1 if kind == "metagrad_q1" else args.queries
            options = MetagradOptions(checkpoint_every=int(every) if every else None,
                                      query_batch=1 if kind == "metagrad_loop" else None)
            metagradients(run, model, loss_fn, batches, queries[:count], query_loss, options=options)
    queue.put({"phase": name, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
               "peak_mib": _rss_mib() - base})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each phase; the least CPU time is kept")
    args = parser.parse_args()
    sqrt_t = max(1, round(args.steps ** 0.5))
    phases = ["train_plain", "train", "replay", "metagrad_q1", "metagrad", "metagrad_loop", "metagrad@1",
              f"metagrad@{args.steps}"]
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = str(Path(tmp) / "run")
        for name in phases:
            best = None
            for _ in range(args.rounds):
                queue = ctx.Queue()
                proc = ctx.Process(target=_phase, args=(name, args, run_dir, queue))
                proc.start()
                row = queue.get()
                proc.join()
                best = row if best is None or row["cpu_seconds"] < best["cpu_seconds"] else best
            rows.append(best)
    params = args.dim * args.hidden + args.hidden + args.hidden * 10 + 10
    print(f"MLP {args.dim}-{args.hidden}-10 ({params:,} params), {args.steps} AdamW steps of batch {args.batch}, "
          f"{args.examples} examples, fp32, CPU {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}; default checkpoint interval {sqrt_t}")
    train = rows[0]
    print(f"{'phase':<22}{'queries':>8}{'wall s':>9}{'cpu s':>9}{'cpu x train':>12}{'peak MiB':>10}")
    for row in rows:
        q = 0 if row["phase"] in ("train_plain", "train", "replay") else \
            (1 if row["phase"] == "metagrad_q1" else args.queries)
        print(f"{row['phase']:<22}{q:>8}{row['seconds']:>9.2f}{row['cpu_seconds']:>9.2f}"
              f"{row['cpu_seconds'] / train['cpu_seconds']:>12.1f}{row['peak_mib']:>10.1f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
