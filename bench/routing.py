"""Does the cost model pick the faster route? Sweep sequence length and layer width, time both exact routes
(ghost = factorized, materialize = form the weight gradients) for the ``[E, E]`` inner products and the
squared norms of a linear layer's per-example gradients, and compare with the model's choice.

    python bench/routing.py                 # default sweep (about a minute on 2 cores)
    python bench/routing.py --examples 32 --reps 5

Prints one row per case: the estimated and measured seconds of each route, the model's choice, the
measured winner, and at the end the agreement rate and the time lost to wrong choices.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from gradtrace.grad.batch import ParamGradient
from gradtrace.grad.cost import CostModel, MachineProfile, TermShape
from gradtrace.grad.ghost import DEFAULT_MAX_BYTES
from gradtrace.grad.ops import param_inner, param_sq_norms
from gradtrace.grad.terms import OuterTerm


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(examples: int, tokens: int, d_in: int, d_out: int, vocab: int | None) -> ParamGradient:
    if vocab is not None:  # an embedding: one-hot rows given by ids
        rows = torch.randint(0, vocab, (examples, tokens))
        term = OuterTerm(rows, torch.randn(examples, tokens, d_out), vocab, d_out)
        return ParamGradient("emb.weight", (vocab, d_out), [term])
    term = OuterTerm(torch.randn(examples, tokens, d_out), torch.randn(examples, tokens, d_in), d_out, d_in)
    return ParamGradient("lin.weight", (d_out, d_in), [term])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    profile = MachineProfile.calibrate()
    model = CostModel(profile)
    print(f"# {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads; "
          f"measured {profile.flops_per_s / 1e9:.1f} GFLOP/s, {profile.bytes_per_s / 1e9:.1f} GB/s, "
          f"{profile.call_overhead_s * 1e6:.1f} us/call; E={args.examples}, fp32, budget "
          f"{DEFAULT_MAX_BYTES >> 20} MiB")
    cases = [("linear", t, d, d, None) for t in (1, 4, 16, 64, 256) for d in (32, 128, 512, 1024)]
    cases += [("linear", t, d, 4 * d, None) for t in (8, 128) for d in (64, 256)]
    cases += [("embed", t, 0, d, v) for t in (16, 128) for d in (64, 256) for v in (1000, 50257)]
    cases += [("lm_head", t, d, v, None) for t in (16, 128) for d in (64,) for v in (1000, 8192)]
    header = (f"{'op':<6}{'layer':<8}{'T':>5}{'d_in':>6}{'d_out':>7}  {'est g':>9}{'est m':>9}  "
              f"{'real g':>9}{'real m':>9}  pick  best")
    print(header)
    agree = total = 0
    lost = spent = 0.0
    for op in ("inner", "norm"):
        for kind, tokens, d_in, d_out, vocab in cases:
            pg = _case(args.examples, tokens, d_in, d_out, vocab)
            if pg.numel * args.examples * 4 * 4 > 2**31:
                continue  # materializing would not fit comfortably in memory
            shape = TermShape.of(pg.terms[0])
            if op == "inner":
                est = {k: c.seconds(profile) for k, c in model.param_inner_costs([shape], [shape]).items()}
                run = {r: (lambda r=r, pg=pg: param_inner(pg, pg, route=r)) for r in est}
            else:
                est = {c.route: c.seconds(profile) for c in model.norm_costs(shape)}
                run = {r: (lambda r=r, pg=pg: param_sq_norms(pg, route=r)) for r in est}
            real = {r: _time(fn, args.reps) for r, fn in run.items()}
            pick, best = min(est, key=est.get), min(real, key=real.get)
            total += 1
            agree += pick == best
            lost += real[pick] - real[best]
            spent += real[best]
            print(f"{op:<6}{kind:<8}{tokens:>5}{d_in if vocab is None else vocab:>6}{d_out:>7}  "
                  f"{est['ghost']:>9.2e}{est['materialize']:>9.2e}  {real['ghost']:>9.2e}{real['materialize']:>9.2e}"
                  f"  {pick[0]:>4}  {best[0]:>4}{'' if pick == best else '  <-- miss'}")
    print(f"\nagreement: {agree}/{total} = {agree / total:.0%}; time lost to wrong picks: {lost:.3f}s "
          f"({lost / spent:.1%} of the best-route total {spent:.3f}s)")


if __name__ == "__main__":
    main()
