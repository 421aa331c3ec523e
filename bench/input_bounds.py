"""Inputs bounded before they are expanded: time and peak memory of reading hostile inputs, bounded and not.

Each case runs in a process of its own (its peak RSS is the process's ``ru_maxrss``), with a wall-clock limit:

* ``jsonl-line``   -- one JSONL record whose text is ``--mb`` MB of prose, loaded with ``max_length=1024,
  truncate=True`` by the demo's byte-level BPE tokenizer (``gradtrace.data.load``, as ``collect --truncate`` does);
* ``completion``   -- the same text as the completion of a prompt/completion record;
* ``yaml-bomb``    -- a 450-byte YAML "billion laughs" (9**9 strings) read as a ``--config`` file.

``--unbounded`` runs each case as it ran before the bound (every text tokenized whole: the prefix tokenization is
switched off; YAML read with ``yaml.safe_load``), for the before/after comparison. Usage::

    python bench/input_bounds.py                   # bounded, 50 MB
    python bench/input_bounds.py --unbounded       # the same cases without the bounds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("jsonl-line", "completion", "yaml-bomb")
BOMB = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))
BOMB = 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB + "out: *i\n"


def _prose(mb: float) -> str:
    from gradtrace.data.corpus import load_plays

    words = " ".join(d.text for d in load_plays(400)).split()
    rng = random.Random(0)
    chunk = " ".join(rng.choice(words) for _ in range(200_000))
    reps = int(mb * 2**20 / len(chunk)) + 1
    return (chunk + " ") * reps


def _run_case(case: str, mb: float, unbounded: bool, work: Path) -> dict:
    started = time.perf_counter()
    if case == "yaml-bomb":
        path = work / "bomb.yaml"
        path.write_text(BOMB)
        if unbounded:
            import yaml

            started = time.perf_counter()
            yaml.safe_load(path.read_text())
            outcome = "expanded"
        else:
            from gradtrace.cli.config import load_config
            from gradtrace.common.errors import UsageError

            started = time.perf_counter()
            try:
                load_config(path, "score", {"score": ["out"]})
                outcome = "read"
            except UsageError as err:
                outcome = f"refused: {str(err)[:70]}..."
        return {"case": case, "seconds": round(time.perf_counter() - started, 3), "outcome": outcome}
    import gradtrace.data as gd
    from gradtrace.data import tokenize
    from gradtrace.data.corpus import load_plays, train_tokenizer
    from gradtrace.options.data import ReadOptions

    tok = train_tokenizer([d.text for d in load_plays(400)])
    text = _prose(mb)
    record = {"text": text} if case == "jsonl-line" else {"prompt": "Tell me a story.", "completion": " " + text}
    path = work / "data.jsonl"
    path.write_text(json.dumps(record) + "\n")
    del text, record
    if unbounded:
        tokenize._prefix_ids = lambda *args: None
    started = time.perf_counter()
    data = gd.load(path, tok, read_options=ReadOptions(max_length=1024, truncate=True))
    return {"case": case, "mb": mb, "seconds": round(time.perf_counter() - started, 2),
            "tokens_kept": len(data.example(0)[0]), "cut": data.summary.cut}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--unbounded", action="store_true")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds a case may run before it is killed")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # a child process: one case
        with tempfile.TemporaryDirectory() as work:
            out = _run_case(args.case, args.mb, args.unbounded, Path(work))
        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(out))
        return
    for case in CASES:
        command = [sys.executable, __file__, "--case", case, "--mb", str(args.mb)] + ["--unbounded"] * args.unbounded
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.limit,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else \
                json.dumps({"case": case, "failed": done.stderr.strip().splitlines()[-1:]})
        except subprocess.TimeoutExpired:
            line = json.dumps({"case": case, "killed_after_s": args.limit})
        mode = "unbounded" if args.unbounded else "bounded"
        print(f"{mode}  {line}  (process {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
