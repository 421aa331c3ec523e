"""Exact streaming top-k against the machine's limit, and the index path (IVF-PQ shortlist + exact re-scoring).

Setup (fixed before any result was looked at; do not tune it to meet a target):

* store: ``--rows`` rows (default 1,000,000) x 4,096 dims, int8 with per-row scales, written through
  :class:`gradtrace.store.ShardWriter` (32,768 rows per shard). Rows are clustered like gradients of related
  examples, with varying norms: ``x_i = s_i * (c_{z_i} + n_i)``, ``C = max(8, rows // 2000)`` centres
  ``c ~ N(0, I)``, ``z_i`` uniform, noise ``n_i ~ N(0, I)``, norm factor ``s_i = exp(0.5 * N(0, 1))``.
* 100 queries ``q = w_a c_a + w_b c_b + n_q`` (two distinct random centres, ``w ~ U(0.5, 1.5)``): each query's
  top-100 is spread over two clusters of ~2,000 rows and decided by norms and noise, not by membership alone.
* method ``grad_dot``, top-100 and bottom-100 per query (what ``Attributor.score(topk=100)`` keeps).
* exact: ``Attributor("grad_dot", store, block_rows=8192).score(queries, topk=100, matrix=False)``.
* limit = max(compute, bandwidth):
  compute -- bare ``torch``: ``queries @ block.T`` + top-100 and bottom-100 merge over all rows, on float32 rows
  already in memory (the first ``min(rows, 131072)`` dequantized store rows, 2 GiB, cycled through in blocks of
  8,192 until every row count is covered: the same FLOPs and top-k work as the engine, no I/O or decoding);
  bandwidth -- one sequential read of every shard file of the store (16 MiB reads), just before the exact run
  (both see the same page-cache state; nothing is dropped from the cache).
* index: ``build_index(store, IndexOptions(kind="ivfpq", ...))`` with ``nlist = 2**round(log2(sqrt(rows)))``
  (1,024 at 1M), ``m = 256`` (16 dims per sub-quantizer), ``nbits = 8`` (256 bytes per row),
  ``train_rows = min(rows, 64 * nlist)`` (65,536 at 1M), searched with ``nprobe = nlist // 32`` (32 at 1M); index
  path: ``score_with_index(..., SearchOptions(rerank=1000, topk=100, nprobe=nprobe))`` (top and bottom, each
  re-scored exactly from the store).
* recall@100: mean over queries of |index top-100 ids & exact top-100 ids| / 100 (and the same for bottom-100).

Targets (issue 14): exact within 1.25x of the limit; recall@100 >= 0.95; index path >= 20x faster than exact.

Variants, printed after the fixed setup's table (added later; the setup above is unchanged): the top-k alone and
more cells for the bottom (``variants``); the fast-scan index (``fast_scan_variant``); and the norm shortlist
(``norm_rows_variant``): the fixed index and the fast-scan one with ``norm_rows = rows // 100`` (the 1% of rows
of largest norm join every query's candidates, top and bottom; 10,000 at 1M). A reused index saved before row
norms were recorded gets them attached (one pass over the store, timed and printed) and saved.

    python bench/index.py --rows 1000000 --dir /tmp/gradtrace-bench-index      # deletes the store at the end
    python bench/index.py --rows 20000                                         # a quick run
    python bench/index.py --rows 200000 --skip-index                           # the exact part alone
    python bench/index.py --rows 1000000 --index /tmp/idx-1m   # builds and saves the index there, or reuses it

``--index PATH`` reuses an index this script saved at PATH for the same ``--rows`` (the store is written again
from the same seed, so its fingerprint matches; a different store is refused), or builds and saves it there
when PATH holds none: the 1M build takes ~20 minutes, the rest of the run a few. ``--store PATH`` reuses a
store this script wrote (its draws are replayed to rebuild the same queries; its first rows are checked).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from gradtrace.options import StoreOptions
from gradtrace.options.index import IndexOptions, SearchOptions

DIM = 4096
QUERIES = 100
TOPK = 100
RERANK = 1000
SHARD_ROWS = 32768
CHUNK = 16384
BLOCK = 8192
RESIDENT = 131072


def setup(rows: int) -> tuple[IndexOptions, int]:
    """The fixed index settings for ``rows`` rows, and the IVF cells searched per query (see the module doc)."""
    nlist = 2 ** round(math.log2(math.sqrt(rows)))
    options = IndexOptions(kind="ivfpq", nlist=nlist, m=256, nbits=8, train_rows=min(rows, 64 * nlist))
    return options, max(1, nlist // 32)


def search(nprobe: int, **options) -> SearchOptions:
    """The fixed search (rerank ``RERANK``, top/bottom ``TOPK``, ``nprobe`` cells) with ``options`` changed."""
    return SearchOptions(rerank=RERANK, topk=TOPK, nprobe=nprobe, **options)


def draw_blocks(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, Iterator[torch.Tensor]]:
    """The cluster centres, and the store's rows block by block (``CHUNK`` rows), drawn from ``gen``."""
    centres = torch.randn(max(8, rows // 2000), DIM, generator=gen)

    def blocks() -> Iterator[torch.Tensor]:
        for start in range(0, rows, CHUNK):
            n = min(CHUNK, rows - start)
            which = torch.randint(0, len(centres), (n,), generator=gen)
            norms = torch.exp(0.5 * torch.randn(n, 1, generator=gen))
            yield (centres[which] + torch.randn(n, DIM, generator=gen)).mul_(norms)
    return centres, blocks()


def write_store(root: Path, rows: int, gen: torch.Generator) -> tuple[object, torch.Tensor]:
    """The clustered int8 store, and the cluster centres."""
    from gradtrace.store import GradientSpec, GradientStore, ShardWriter

    spec = GradientSpec([("synthetic.weight", DIM)], None, {"reduction": "sum", "example_loss": "sum"}, {},
                        "int8")
    centres, blocks = draw_blocks(rows, gen)
    writer = ShardWriter(root, spec, StoreOptions(shard_rows=SHARD_ROWS, queue_size=4), rank=0, world_size=1)
    try:
        for start, block in zip(range(0, rows, CHUNK), blocks):
            writer.put([f"row{i}" for i in range(start, start + len(block))], block)
    finally:
        writer.close()
    return GradientStore.open(root, verify=False), centres


def reuse_store(root: Path, rows: int, gen: torch.Generator) -> tuple[object, torch.Tensor]:
    """A store :func:`write_store` wrote earlier with the same ``rows`` and seed: its draws are replayed (not
    written) so that ``gen`` reaches the queries' state; its first rows are checked against the replay."""
    from gradtrace.grad.quantize import quantize
    from gradtrace.store import GradientStore

    store = GradientStore.open(root, verify=False)
    centres, blocks = draw_blocks(rows, gen)
    first = next(blocks)
    if len(store) != rows or not torch.equal(store.read(0, 64), quantize(first[:64]).dequantize()):
        raise SystemExit(f"{root} is not the store this script writes for --rows {rows}")
    for _ in blocks:
        pass
    return store, centres


def make_queries(centres: torch.Tensor, gen: torch.Generator):
    import gradtrace
    from gradtrace.store import GradientSpec

    pairs = torch.stack([torch.randperm(len(centres), generator=gen)[:2] for _ in range(QUERIES)])
    weights = 0.5 + torch.rand(QUERIES, 2, 1, generator=gen)
    vectors = (centres[pairs] * weights).sum(1) + torch.randn(QUERIES, DIM, generator=gen)
    spec = GradientSpec([("synthetic.weight", DIM)], None, {"reduction": "sum", "example_loss": "sum"})
    return gradtrace.GradientSet(vectors, [f"q{i}" for i in range(QUERIES)], spec)


def sequential_read(store) -> tuple[float, int]:
    """Seconds to read every shard file once, sequentially, and the bytes read."""
    buffer = bytearray(16 * 2**20)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for shard in store.shards:
        for info in shard.record["files"].values():
            with open(store.root / "shards" / info["name"], "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return time.perf_counter() - start, total


def bare_compute(store, queries: torch.Tensor) -> float:
    """Seconds of ``queries @ block.T`` + top/bottom-k merges over ``len(store)`` rows held in memory."""
    from gradtrace.score.engine import _merge

    resident = store.read(0, min(len(store), RESIDENT))
    rows = len(store)
    start = time.perf_counter()
    top = bottom = None
    for offset in range(0, rows, BLOCK):
        n = min(BLOCK, rows - offset)
        lo = offset % len(resident)
        block = resident[lo:lo + n] if lo + n <= len(resident) else resident[:n]
        scores = queries @ block.t()
        top = _merge(top, scores, offset, TOPK, largest=True)
        bottom = _merge(bottom, scores, offset, TOPK, largest=False)
    elapsed = time.perf_counter() - start
    del resident
    return elapsed


def variants(attr, queries, index, nprobe: int, exact, exact_s: float, score_with_index) -> None:
    """Variants next to the fixed setup (added after its first results; the setup above is unchanged): the top-k
    alone, and the bottom-k's search with more IVF cells (``bottom_nprobe``: 4x and 16x ``nprobe``)."""
    print(f"\n| variant (rerank {RERANK}, {QUERIES} queries) | index path | speed-up over exact | recall@{TOPK} top / "
          "bottom |\n|---|---|---|---|")
    for label, options in ((f"top only, nprobe {nprobe}", {"bottom": False}),
                           *((f"top and bottom, bottom_nprobe {f * nprobe}", {"bottom_nprobe": f * nprobe})
                             for f in (4, 16))):
        t = time.perf_counter()
        got = score_with_index(attr, queries, index, search(nprobe, **options))
        elapsed = time.perf_counter() - t
        bottom = f"{recall(got.bottom[1], exact.bottom[1]):.4f}" if got.bottom is not None else "-"
        print(f"| {label} | {elapsed:.2f} s | {exact_s / elapsed:.1f}x | {recall(got.top[1], exact.top[1]):.4f} / "
              f"{bottom} |")


NORM_FRACTIONS = (0.01, 0.05)  # fixed before any 200k/1M result of the variant was seen


def norm_rows_variant(store, attr, queries, index, nprobe: int, exact, exact_s: float, name: str,
                      score_with_index) -> None:
    """A variant next to the fixed setup (added after its results were published; the setup above is unchanged):
    ``index`` with ``norm_rows`` = 1% and 5% of the rows (:data:`NORM_FRACTIONS`), top and bottom. Norms missing
    from a reused index are attached first (one pass over the store, timed separately) and saved with it."""
    if index.row_norms is None:
        t, cpu = time.perf_counter(), time.process_time()
        index.attach_row_norms(store)
        note = (f"attached to the reused index in {time.perf_counter() - t:.1f} s (CPU {time.process_time() - cpu:.1f}"
                f" s; one pass over the store) and saved in {index.path}")
    else:
        note = "recorded when the index was built"
    print(f"\n| norm-shortlist variant ({name} {index.params.factory()}, rerank {RERANK}) | index path | speed-up over "
          f"exact | CPU | recall@{TOPK} top / bottom |\n|---|---|---|---|---|\n| row norms: {note} | | | | |")
    for fraction in NORM_FRACTIONS:
        norm_rows = max(1, round(len(store) * fraction))
        t, cpu = time.perf_counter(), time.process_time()
        got = score_with_index(attr, queries, index, search(nprobe, norm_rows=norm_rows))
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        profile = got.meta["profile"]
        print(f"| top and bottom, norm_rows {norm_rows:,} ({fraction:.0%} of rows; scoring them: "
              f"{profile['norm_rows_s']:.2f} s; search {profile['search_top_s'] + profile['search_bottom_s']:.2f} s, "
              f"re-scoring {profile['rerank_top_s'] + profile['rerank_bottom_s']:.2f} s) | {elapsed:.2f} s | "
              f"{exact_s / elapsed:.1f}x | {cpu:.1f} s | {recall(got.top[1], exact.top[1]):.4f} / "
              f"{recall(got.bottom[1], exact.bottom[1]):.4f} |")
    print(f"| load average (1, 5, 15 min) after the variant | {load()} | | | |")


def load_or_build(store, where: Path, options: IndexOptions):
    """The ivfpq index saved at ``where`` (checked against ``store``), or one built with ``options`` and saved
    there; and its build seconds (as recorded when it was built)."""
    from gradtrace.score.index import Index, build_index

    if (where / "index.json").exists():
        index = Index.load(where)
        index.check_store(store)
        print(f"index reused from {where} (built {index.meta.get('built')})")
        return index, float(index.meta["build_s"])
    t = time.perf_counter()
    index = build_index(store, options, block_rows=65536)
    build_s = time.perf_counter() - t
    index.save(where)
    return index, build_s


def fast_scan_variant(store, attr, queries, exact, exact_s: float, settings: IndexOptions, nprobe: int,
                      where: Path, score_with_index):
    """A variant next to the fixed setup (added after its results were published; the setup above is unchanged):
    the same cells, ``nprobe`` and training sample, with 4-bit fast-scan codes of the same size (``m = 512``
    sub-quantizers of 8 dims x 4 bits = 256 bytes per row, as ``PQ256x8``): FAISS's SIMD fast-scan search.
    Built and saved at ``where`` (or reused from there); returned for :func:`norm_rows_variant`."""
    index, build_s = load_or_build(store, where, replace(settings, m=2 * settings.m, nbits=None, fast_scan=True))
    size = sum(f.stat().st_size for f in where.iterdir())
    print(f"\n| fast-scan variant ({index.params.factory()}, nprobe {nprobe}, rerank {RERANK}) | value |"
          f"\n|---|---|\n| index build | {build_s:.1f} s (train {index.meta.get('train_s', 0):.1f} s, add "
          f"{index.meta.get('add_s', 0):.1f} s) |\n| index size | {size / 2**20:.1f} MiB |")
    for label, options in (("top and bottom", {}), ("top only", {"bottom": False})):
        t, cpu = time.perf_counter(), time.process_time()
        got = score_with_index(attr, queries, index, search(nprobe, **options))
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        profile = got.meta["profile"]
        searched = profile["search_top_s"] + profile.get("search_bottom_s", 0.0)
        rescore = profile["rerank_top_s"] + profile.get("rerank_bottom_s", 0.0)
        bottom = f"{recall(got.bottom[1], exact.bottom[1]):.4f}" if got.bottom is not None else "-"
        print(f"| index path, {label} | {elapsed:.2f} s = **{exact_s / elapsed:.1f}x** faster than exact (search "
              f"{searched:.2f} s, re-scoring {rescore:.2f} s; CPU {cpu:.1f} s); recall@{TOPK} top / bottom "
              f"{recall(got.top[1], exact.top[1]):.4f} / {bottom} |")
    print(f"| load average (1, 5, 15 min) after the variant | {load()} |")
    return index


def load() -> str:
    """The machine's load averages (1, 5, 15 minutes): the benchmark runs on shared machines."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    hits = [len(set(a) & set(b)) for a, b in zip(found.tolist(), truth.tolist())]
    return sum(hits) / (len(hits) * truth.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="store rows (default 1,000,000)")
    parser.add_argument("--dir", type=Path, default=None, help="where the store and index go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the store and index (default: deleted)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--index", type=Path, default=None,
                        help="reuse the index saved at this path (same --rows), or build and save it there")
    parser.add_argument("--store", type=Path, default=None,
                        help="reuse a store this script wrote (same --rows; kept with --keep) instead of writing one")
    parser.add_argument("--skip-fast-scan", action="store_true",
                        help="skip the fast-scan variant (a second index, saved next to --index as INDEX-fastscan)")
    parser.add_argument("--skip-index", action="store_true",
                        help="measure the exact part only (limits and exact streaming; no index build or search)")
    args = parser.parse_args()

    import faiss

    import gradtrace
    from gradtrace.score.shortlist import score_with_index

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="gradtrace-bench-index-"))
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} is not empty")
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    settings, nprobe = setup(args.rows)
    print(f"# {platform.machine()} {os.cpu_count()} cpus ({args.threads} threads), torch {torch.__version__}, "
          f"faiss {faiss.__version__}; {args.rows:,} rows x {DIM} int8, {QUERIES} queries, top/bottom-{TOPK}")
    try:
        t = time.perf_counter()
        if args.store:
            store, centres = reuse_store(args.store, args.rows, gen)
            print(f"store {args.store} reused (draws replayed in {time.perf_counter() - t:.1f} s)")
        else:
            store, centres = write_store(root / "store", args.rows, gen)
            print(f"store written in {time.perf_counter() - t:.1f} s: {len(store.shards)} shards, "
                  f"{store.info()['bytes'] / 2**30:.2f} GiB")
        queries = make_queries(centres, gen)

        read_s, read_bytes = sequential_read(store)
        cpu = time.process_time()
        compute_s = bare_compute(store, queries.vectors)
        compute_cpu = time.process_time() - cpu
        attr = gradtrace.Attributor("grad_dot", store, block_rows=BLOCK)
        t, cpu = time.perf_counter(), time.process_time()
        exact = attr.score(queries, topk=TOPK, matrix=False)
        exact_s, exact_cpu = time.perf_counter() - t, time.process_time() - cpu
        limit = max(compute_s, read_s)
        exact_table = [
            f"| bandwidth limit: sequential read of {read_bytes / 2**30:.2f} GiB | {read_s:.2f} s "
            f"({read_bytes / read_s / 2**30:.2f} GiB/s) |",
            f"| compute limit: bare matmul + top/bottom-{TOPK} in memory | {compute_s:.2f} s "
            f"(CPU {compute_cpu:.1f} s) |",
            f"| exact streaming top-{TOPK} (Attributor.score) | {exact_s:.2f} s = **{exact_s / limit:.2f}x** "
            f"the limit (target <= 1.25x); CPU {exact_cpu:.1f} s = {exact_cpu / compute_cpu:.2f}x the compute "
            "limit's |", f"| load average (1, 5, 15 min) after the exact run | {load()} |"]
        if args.skip_index:
            print("\n| quantity | value |\n|---|---|\n" + "\n".join(exact_table))
            return

        index_dir = args.index or root / "index"
        index, build_s = load_or_build(store, index_dir, settings)
        index_bytes = sum(f.stat().st_size for f in index_dir.iterdir())
        t, cpu = time.perf_counter(), time.process_time()
        approx = score_with_index(attr, queries, index, search(nprobe))
        index_s, index_cpu = time.perf_counter() - t, time.process_time() - cpu

        same = approx.top[1] == exact.top[1]
        value_error = float(((approx.top[0] - exact.top[0]).abs() / exact.top[0].abs().clamp(min=1e-30))[same].max()) \
            if bool(same.any()) else float("nan")
        print()
        print("| quantity | value |")
        print("|---|---|")
        print("\n".join(exact_table))
        print(f"| index build ({index.params.factory()}, searched with nprobe {nprobe}, trained on "
              f"{index.params.train_rows:,} rows) | {build_s:.1f} s (train {index.meta.get('train_s', 0):.1f} s, "
              f"add {index.meta.get('add_s', 0):.1f} s) |")
        print(f"| index size | {index_bytes / 2**20:.1f} MiB ({index_bytes / args.rows:.0f} B/row; store "
              f"{read_bytes / 2**20:.0f} MiB) |")
        print(f"| index path: search + exact re-scoring of {RERANK}/query, top and bottom | {index_s:.2f} s = "
              f"**{exact_s / index_s:.1f}x** faster than exact (target >= 20x); CPU {index_cpu:.1f} s = "
              f"{exact_cpu / index_cpu:.1f}x less than exact |")
        profile = approx.meta["profile"]
        print(f"|   of which search / re-scoring | {profile['search_top_s'] + profile['search_bottom_s']:.2f} s / "
              f"{profile['rerank_top_s'] + profile['rerank_bottom_s']:.2f} s |")
        widened = approx.meta["index"]["widened"]
        print(f"| queries searched with more cells (fewer than {TOPK} rows in {nprobe}) top / bottom | "
              f"{widened.get('top', 0)} / {widened.get('bottom', 0)} |")
        print(f"| recall@{TOPK} top / bottom | **{recall(approx.top[1], exact.top[1]):.4f}** / "
              f"{recall(approx.bottom[1], exact.bottom[1]):.4f} (target >= 0.95) |")
        print(f"| max relative difference of scores at the same rank and row (index path vs exact) | "
              f"{value_error:.1e} |")
        print(f"| load average (1, 5, 15 min) after the index path | {load()} |")
        variants(attr, queries, index, nprobe, exact, exact_s, score_with_index)
        norm_rows_variant(store, attr, queries, index, nprobe, exact, exact_s, "fixed index", score_with_index)
        if not args.skip_fast_scan:
            fast = fast_scan_variant(store, attr, queries, exact, exact_s, settings, nprobe, index_dir.with_name(
                index_dir.name + "-fastscan"), score_with_index)
            norm_rows_variant(store, attr, queries, fast, nprobe, exact, exact_s, "fast-scan index", score_with_index)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
