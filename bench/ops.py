"""Inner-product throughput of each route, as pairs per second and as a fraction of this machine's matmul rate.

For a linear layer's per-example gradients (E x E pairs) at a few shapes, times the ghost (factorized) and the
materialize route of ``gradtrace.grad.ops``, and the plain matmul of projected vectors (what scoring a store
does). The FLOP count of each route is the cost model's; "of peak" divides the achieved FLOP rate by the
measured rate of a large float32 matmul on this machine.

    python bench/ops.py
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
from gradtrace.grad.ops import param_inner
from gradtrace.grad.terms import DenseTerm, OuterTerm


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_matmul(reps: int) -> float:
    a = torch.randn(2048, 2048)
    return 2 * 2048**3 / _time(lambda: a @ a, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    peak = _peak_matmul(args.reps)
    model = CostModel(MachineProfile.calibrate())
    e = args.examples
    print(f"# {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads, fp32; "
          f"E={e} (E^2 = {e * e} pairs); peak matmul {peak / 1e9:.1f} GFLOP/s (2048^3)")
    print(f"{'shape':<28}{'route':<13}{'seconds':>10}{'pairs/s':>12}{'GFLOP/s':>10}{'of peak':>9}")
    shapes = [(16, 512, 512), (128, 512, 512), (64, 1024, 4096), (512, 256, 256)]
    for tokens, d_in, d_out in shapes:
        term = OuterTerm(torch.randn(e, tokens, d_out), torch.randn(e, tokens, d_in), d_out, d_in)
        pg = ParamGradient("w", (d_out, d_in), [term])
        shape = TermShape.of(term)
        costs = model.param_inner_costs([shape], [shape])
        label = f"T={tokens} {d_in}->{d_out}"
        for route in ("ghost", "materialize"):
            seconds = _time(lambda route=route, pg=pg: param_inner(pg, pg, route=route), args.reps)
            flops = costs[route].flops
            print(f"{label:<28}{route:<13}{seconds:>10.4f}{e * e / seconds:>12.3g}{flops / seconds / 1e9:>10.1f}"
                  f"{flops / seconds / peak:>9.0%}")
    for k in (4096, 65536):
        pg = ParamGradient("p", (k,), [DenseTerm(torch.randn(e, k))])
        queries = ParamGradient("p", (k,), [DenseTerm(torch.randn(16, k))])
        seconds = _time(lambda pg=pg, queries=queries: param_inner(queries, pg, route="materialize"), args.reps)
        flops = 2.0 * 16 * e * k
        print(f"{f'projected k={k} (16 x E)':<28}{'matmul':<13}{seconds:>10.4f}{16 * e / seconds:>12.3g}"
              f"{flops / seconds / 1e9:>10.1f}{flops / seconds / peak:>9.0%}")


if __name__ == "__main__":
    main()
