"""How fitting and scoring time of the curvature methods grow with the number of training examples and the
layer width.

Model: an MLP ``width -> width -> width -> 10`` (tanh), random inputs and labels, batch 64, fp32. For each
setting: ``fit`` = ``Attributor(method, train).fit(model, data)`` (K-FAC: one pass; EK-FAC: two passes;
logra: from the stored LoGra-32 gradients, no model pass) and ``score`` = scoring 64 queries against all
training examples (query-side inverse once + one streamed matrix product). Exact gradients for kfac/ekfac
(dimension ~2 width^2), LoGra rank 32 for logra and trak.

The whole-model methods (``arnoldi``, ``cg``, ``ggn_full``) run with their default options (the exact Gauss-Newton
matrix from products with the model; ``arnoldi`` rank 128 with 256 iterations), the others with the empirical
Fisher; ``trak``'s fit includes the forward pass for the 1 - p weights. ``--sizes`` picks (width, N) settings.
``trak`` fits the ``D x D`` kernel (``mode="primal"``, as the rows first published), ``trak+dual`` the ``N x N``
Gram matrix of the same rows (what ``mode="auto"`` picks when ``N < D``; two more passes over the rows per query
set at scoring).

``trackstar`` needs Adam's second moment: one Adam step per batch over the data is taken before collecting
(not timed), and its ``fit`` reads that state. ``trackstar`` alone runs on exact gradients without
preconditioning; ``trackstar+autocorrelation`` on LoGra rank 32 gradients with TrackStar's own ``R`` (the paper's
setting); ``trackstar+autocorrelation-parameter`` the same with ``R`` one block per parameter
(``structure="parameter"``); ``trackstar+ekfac`` on exact gradients with an EK-FAC fitted inside (empirical Fisher,
as ``ekfac``).

    python bench/curvature.py
    python bench/curvature.py --methods arnoldi cg trak --sizes 64x1024,128x1024,256x256,256x1024
    python bench/curvature.py --methods trak trak+dual --sizes 64x1024,128x1024,256x256,256x1024
    python bench/curvature.py --methods trackstar trackstar+autocorrelation trackstar+ekfac
    python bench/curvature.py --methods trackstar+autocorrelation trackstar+autocorrelation-parameter
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from torch import nn

import gradtrace
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions

WHOLE_MODEL = ("arnoldi", "cg", "ggn_full")
SIZES = [(256, 256), (256, 1024), (256, 4096), (64, 1024), (128, 1024), (512, 1024)]


def _setup(width: int, n: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 10))
    x, y = torch.randn(n, width), torch.randint(0, 10, (n,))
    data = [(x[i:i + 64], y[i:i + 64]) for i in range(0, n, 64)]
    queries = [(torch.randn(64, width), torch.randint(0, 10, (64,)))]
    return model, data, queries


def _adam(model: nn.Module, data) -> torch.optim.Adam:
    """An Adam optimizer after one step per batch of ``data`` (its second moment is what trackstar reads)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return optimizer


def _measure(method: str, width: int, n: int) -> tuple[float, float, int]:
    model, data, queries = _setup(width, n)
    name, _, precondition = method.partition("+")
    fit_options = {"optimizer": _adam(model, data)} if name == "trackstar" else {}
    projected = name in ("logra", "trak") or precondition.startswith("autocorrelation")
    projection = gradtrace.LoGra(rank=32) if projected else None
    train = gradtrace.collect(model, data, classification_loss, options=CaptureOptions(projection=projection))
    q = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=projection))
    if name == "trackstar":
        options = {"precondition": precondition or None}
        if precondition == "autocorrelation-parameter":
            options = {"precondition": "autocorrelation", "structure": "parameter"}
        elif precondition not in ("", "autocorrelation"):
            options["precondition_options"] = {"fisher": "empirical"}
    elif name == "trak":  # "trak": the D x D kernel (the rows published first); "trak+dual": the N x N Gram matrix
        options = {"mode": precondition or "primal"}
    else:
        options = {} if name in WHOLE_MODEL else {"fisher": "empirical"}
    attr = gradtrace.Attributor(name, train, **options)
    start = time.perf_counter()
    if name == "logra":
        attr.fit()
    else:
        attr.fit(model, data, classification_loss, **fit_options)
    fit = time.perf_counter() - start
    start = time.perf_counter()
    attr.score(q, topk=10)
    return fit, time.perf_counter() - start, train.dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["kfac", "ekfac", "logra"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sizes", default=None, help="comma-separated WIDTHxN settings (default: the six above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads; MLP "
          "width->width->width->10, batch 64, 64 queries, fp32")
    print(f"{'method':<36}{'width':>7}{'N':>7}{'dim':>10}{'fit s':>9}{'score s':>9}{'fit us/example':>16}")
    for method in args.methods:
        sizes = ([tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")] if args.sizes
                 else SIZES)
        for width, n in sizes:
            fit, score, dim = _measure(method, width, n)
            print(f"{method:<36}{width:>7}{n:>7}{dim:>10,}{fit:>9.2f}{score:>9.2f}{fit / n * 1e6:>16.0f}", flush=True)


if __name__ == "__main__":
    main()
