"""Peak memory of saving an artifact (fitted curvature, a method fit, scores): what ``write_artifact`` adds on top
of the tensors it saves.

Each size runs in a fresh process: it builds ``--gib`` GiB of float64 tensors (blocks of 4096 x 4096, like a
per-parameter TrackStar fit or the eigenbases of a large curvature), records the process's peak resident memory,
saves them with ``gradtrace.store.artifact.write_artifact``, and records the peak again. The difference is the
save's own memory; before tensor files were written straight from the tensors (``safetensors.torch.save_file``)
it was about twice the tensors' size (a serialized copy and its pieces).

    python bench/save_memory.py [--gib 0.5 1 2] [--source OTHER_CHECKOUT]   # e.g. a git worktree of an older commit
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile

CHILD = """
import json, resource, sys, time
if sys.argv[3]:
    sys.path.insert(0, sys.argv[3])  # --source: another checkout's gradtrace
import torch
from gradtrace.store.artifact import write_artifact
gib, out = float(sys.argv[1]), sys.argv[2]
side = 4096
count = max(1, round(gib * 2**30 / (8 * side * side)))
tensors = {f"block.{i}": torch.randn(side, side, dtype=torch.float64) for i in range(count)}
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
start = time.perf_counter()
write_artifact(out, "bench", "gradtrace-bench", 1, {}, tensors)
print(json.dumps({"bytes": 8 * side * side * count, "before": before, "after": peak(),
                  "seconds": time.perf_counter() - start}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--source", default="", help="a checkout whose gradtrace is measured instead")
    args = parser.parse_args()
    print(f"# {platform.machine()}, python {platform.python_version()}, gradtrace from "
          f"{args.source or 'this checkout'}")
    print("| tensors | peak before the save | peak after | the save's own | seconds |")
    print("|---|---|---|---|---|")
    for gib in args.gib:
        with tempfile.TemporaryDirectory() as out:
            result = subprocess.run([sys.executable, "-c", CHILD, str(gib), out, args.source],
                                    capture_output=True, text=True, check=True)
        row = json.loads(result.stdout.strip().splitlines()[-1])
        own = row["after"] - row["before"]
        print(f"| {row['bytes'] / 2**30:.2f} GiB | {row['before'] / 2**30:.2f} GiB | {row['after'] / 2**30:.2f} GiB "
              f"| {own / 2**30:.2f} GiB ({own / row['bytes']:.2f}x) | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
