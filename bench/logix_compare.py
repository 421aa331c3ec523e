"""LoGra fidelity: gradtrace's ``logra`` against LogIX's LoGra (logix-ai 0.1.1), side by side, on the bundled tasks.

For each task (``digits_mlp``, ``tinylm``) and LoGra rank (``--ranks``, default 16 and 32):

* **gradtrace**: ``logra`` with its default options on LoGra-projected gradients of the task's model
  (``gradtrace.eval.evaluate`` with ``MethodSpec("logra", projection=gradtrace.LoGra(rank=r))``, as
  ``bench/quality.py`` runs it);
* **LogIX**: the same trained model (its state dict), the same training and query examples (the task's batches
  of ``--batch-size``, ids kept) and the same per-example loss (the example's summed loss: cross-entropy for the
  classifier, next-token cross-entropy summed over target tokens for the LM), run by LogIX's documented API in a
  subprocess of the LogIX virtual environment (``--logix-python``): ``LogIX(project, config)``, ``watch(model)``,
  ``add_lora()`` (LoGra: rank ``r`` encoders ``A``, ``C`` initialised at random, LogIX's default, seed 0; the
  gradient is logged on the ``r x r`` bottleneck), one pass over the training data per statistic
  (``setup({"forward": ["covariance"], "backward": ["covariance"], "grad": ["log"]})``; EK-FAC adds a pass with
  ``{"grad": ["log", "corrected_eigval"]}``; ``raw``: ``{"grad": ["log", "covariance"]}``), ``finalize()``, the
  queries' log under ``eval()``, and ``compute_influence(query_log, train_log, hessian=..., damping=None)``
  (LogIX's default damping) per training batch. Each of LogIX's three Hessians (``kfac``, ``ekfac``, ``raw``) is
  one row. The subprocess saves the score matrices to a file; the LDS is computed here by
  ``gradtrace.eval.lds`` against the cached ground truth of ``bench/quality.py`` (``--cache``, the same default
  directory and subset counts; built if missing).

LogIX watches ``nn.Linear`` / ``nn.Conv2d`` modules only (weights, no biases, no embeddings or norms): on the
classifier that is the three linear layers' weights; GPT-2's transformer layers are ``transformers``' ``Conv1D``,
which LogIX does not support, so the LogIX copy of the LM has each ``Conv1D`` replaced by the equivalent
``nn.Linear`` (the same function: weight transposed), and LogIX covers the four projections of the block and the
``lm_head`` (tied to the token embedding). gradtrace's ``logra`` covers every parameter (biases, norms, position
embedding included). Positive score = the training example helps the query, in both libraries.

    python bench/logix_compare.py                              # both tasks, ranks 16 and 32
    python bench/logix_compare.py --tasks tinylm --ranks 16 --logix-python /work/logix-venv/bin/python

Setting up the LogIX environment (never in gradtrace's own):
    python3.11 -m venv /work/logix-venv && /work/logix-venv/bin/pip install torch==2.13.0 "numpy<2.4" \
        einops pyyaml tqdm transformers && /work/logix-venv/bin/pip install logix-ai==0.1.1 --ignore-requires-python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HESSIANS = ("kfac", "ekfac", "raw")  # LogIX's preconditioners, one row each
# the ``hessian=`` LogIX's influence takes for each: its K-FAC preconditioner uses the corrected eigenvalues
# when the EK-FAC pass has run
LOGIX_HESSIAN = {"kfac": "kfac", "ekfac": "kfac", "raw": "raw"}
TASKS = ("digits_mlp", "tinylm")
LORA_SEED = 0  # torch seed before LogIX's add_lora (its random encoder initialisation)


# ------------------------------------------------------------------------------------------------------------------
# the LogIX side: runs in the LogIX virtual environment; imports torch, logix (and transformers for the LM) only
# ------------------------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """The digits_mlp architecture rebuilt from its state dict: ``hidden.{i}`` linear + ReLU, then ``out``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        count = len([k for k in state if k.startswith("hidden.") and k.endswith(".weight")])
        shapes = [state[f"hidden.{i}.weight"].shape for i in range(count)]
        self.hidden = nn.ModuleList(nn.Linear(d_in, d_out) for d_out, d_in in shapes)
        self.out = nn.Linear(state["out.weight"].shape[1], state["out.weight"].shape[0])
        self.load_state_dict(state)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        acts = inputs
        for layer in self.hidden:
            acts = torch.relu(layer(acts))
        return self.out(acts)


def _gpt2(state: dict[str, torch.Tensor], config: dict[str, Any]) -> nn.Module:
    """The GPT-2 rebuilt from its config and state dict, each ``Conv1D`` replaced by the same ``nn.Linear``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel(GPT2Config.from_dict(config))
    model.load_state_dict(state)
    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            linear = nn.Linear(module.weight.shape[0], module.weight.shape[1])
            linear.weight.data.copy_(module.weight.data.t())
            linear.bias.data.copy_(module.bias.data)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model.eval()


def _example_losses(kind: str, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """``[B]``: each example's summed loss (gradtrace's classification_loss / causal_lm_loss)."""
    if kind == "mlp":
        return nn.functional.cross_entropy(model(batch["inputs"]), batch["labels"], reduction="none")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    per_token = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                            reduction="none")
    return per_token.view(labels.shape).sum(1)


def _logix_pass(run: Any, kind: str, model: nn.Module, batches: list[dict[str, Any]], keep: bool) -> list[Any]:
    """One pass of LogIX's logging over ``batches``; the per-batch logs when ``keep``."""
    logs = []
    for batch in batches:
        with run(data_id=batch["id"], mask=batch.get("attention_mask")):
            model.zero_grad(set_to_none=True)
            _example_losses(kind, model, batch).sum().backward()
        if keep:
            logs.append(run.get_log(copy=True))
    return logs


def logix_scores(inputs: dict[str, Any], hessian: str, root: str) -> torch.Tensor:
    """``[Q, N]`` LogIX LoGra influence of every training example on every query (see the module docstring)."""
    import yaml
    from logix.logix import LogIX

    kind, rank = inputs["kind"], inputs["rank"]
    model = MLP(inputs["state"]) if kind == "mlp" else _gpt2(inputs["state"], inputs["config"])
    config = Path(root) / f"{hessian}.yaml"
    config.write_text(yaml.safe_dump({"root_dir": root, "lora": {"init": "random", "rank": rank}}))
    run = LogIX(project=f"{kind}-{rank}-{hessian}", config=str(config))
    run.watch(model)
    torch.manual_seed(LORA_SEED)
    run.add_lora()
    train = inputs["train"]
    if hessian == "raw":
        run.setup({"grad": ["log", "covariance"]})
        logs = _logix_pass(run, kind, model, train, keep=True)
        run.finalize()
    else:
        run.setup({"forward": ["covariance"], "backward": ["covariance"], "grad": ["log"]})
        logs = _logix_pass(run, kind, model, train, keep=True)
        run.finalize()
        if hessian == "ekfac":
            run.setup({"grad": ["log", "corrected_eigval"]})
            _logix_pass(run, kind, model, train, keep=False)
            run.finalize()
    run.setup({"grad": ["log"]})
    run.eval()
    (query,) = _logix_pass(run, kind, model, inputs["queries"], keep=True)
    prepared = run.influence.precondition(query, hessian=LOGIX_HESSIAN[hessian], damping=None)
    parts = [run.compute_influence(prepared, log, precondition=False)["influence"] for log in logs]
    return torch.cat(parts, dim=1)


def worker(path: str) -> None:
    """Read the inputs file, write ``{hessian: scores [Q, N]}`` next to it (``scores.pt``)."""
    inputs = torch.load(path, weights_only=True)
    torch.set_num_threads(inputs["threads"])
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for hessian in inputs["hessians"]:
            began = time.perf_counter()
            out[hessian] = logix_scores(inputs, hessian, root).to(torch.float32)
            out[f"{hessian}_seconds"] = torch.tensor(time.perf_counter() - began)
    torch.save(out, Path(path).with_name("scores.pt"))


# ------------------------------------------------------------------------------------------------------------------
# the gradtrace side
# ------------------------------------------------------------------------------------------------------------------
def _inputs(task: Any, rank: int, batch_size: int, threads: int) -> dict[str, Any]:
    """What the LogIX subprocess needs: the trained weights, the architecture, the batches with their ids."""
    model = task.model
    kind = "mlp" if task.name.startswith("digits") else "gpt2"
    keys = ("inputs", "labels", "id") if kind == "mlp" else ("input_ids", "attention_mask", "id")
    train = [{k: b[k] for k in keys} for b in task.train_batches(batch_size)]
    queries = [{k: b[k] for k in keys} for b in task.query_batches()]
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    config = model.config.to_dict() if kind == "gpt2" else {}
    config = json.loads(json.dumps(config, default=str))
    return {"kind": kind, "rank": rank, "state": state, "config": config, "train": train, "queries": queries,
            "hessians": list(HESSIANS), "threads": threads}


def _run_logix(python: str, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "inputs.pt"
        torch.save(inputs, path)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # LogIX's venv, not gradtrace
        subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(path)], check=True, env=env, cwd=work)
        return torch.load(Path(work) / "scores.pt", weights_only=True)


def _paired(diff: torch.Tensor) -> str:
    diff = diff[torch.isfinite(diff)]
    return f"{float(diff.mean()):+.3f} ± {float(diff.std() / diff.numel() ** 0.5):.3f}"


def compare(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import gradtrace
    from gradtrace.eval import MethodSpec, build_lds_ground_truth, evaluate, get_task, lds
    from gradtrace.options.eval import LDSOptions

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality import DEFAULT_SUBSETS

    task = get_task(name)
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, cache=Path(args.cache) / name,
                                   config=task.config, options=LDSOptions(num_subsets=DEFAULT_SUBSETS[name]))
    print(f"\n### {name}: {task.describe()}\nground truth: {truth.num_subsets} subsets of "
          f"{truth.meta['subset_size']}, {task.num_queries} queries ({Path(args.cache) / name})\n")
    print("| rank | library | method | LDS ± SE | ours - this (paired) | s |\n|---|---|---|---|---|---|")
    results = []
    for rank in args.ranks:
        spec = MethodSpec("logra", projection=gradtrace.LoGra(rank=rank), label=f"logra (LoGra rank {rank})")
        (ours,) = evaluate(task, [spec], truth, batch_size=args.batch_size)
        print(f"| {rank} | gradtrace | `logra` (default) | {ours.lds_mean:.3f} ± {ours.lds_se:.3f} | | "
              f"{ours.seconds:.1f} |")
        results.append({"task": name, "rank": rank, "library": "gradtrace", "method": "logra",
                        "lds_mean": ours.lds_mean, "lds_se": ours.lds_se, "seconds": ours.seconds,
                        "lds_per_query": ours.lds.per_query.tolist()})
        scores = _run_logix(args.logix_python, _inputs(task, rank, args.batch_size, args.threads))
        for hessian in HESSIANS:
            matrix = scores[hessian]
            result = lds(matrix, truth.masks, truth.outcomes)
            seconds = float(scores[f"{hessian}_seconds"])
            print(f"| {rank} | LogIX 0.1.1 | LoGra, `hessian={hessian!r}` | {result.mean:.3f} ± {result.se:.3f} | "
                  f"{_paired(ours.lds.per_query - result.per_query)} | {seconds:.1f} |")
            results.append({"task": name, "rank": rank, "library": "logix", "method": hessian,
                            "lds_mean": result.mean, "lds_se": result.se, "seconds": seconds,
                            "lds_per_query": result.per_query.tolist()})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (digits_mlp, tinylm)")
    parser.add_argument("--ranks", default="16,32", help="comma-separated LoGra ranks")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per batch (both libraries)")
    parser.add_argument("--cache", default=".cache/gradtrace-quality", help="bench/quality.py's ground-truth cache")
    parser.add_argument("--logix-python", default="/work/logix-venv/bin/python",
                        help="python of the virtual environment with logix-ai 0.1.1")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both processes)")
    parser.add_argument("--json", default=None, help="also write the rows (with per-query LDS) to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the LogIX subprocess
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    torch.set_num_threads(args.threads)
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    print(f"torch {torch.__version__}, {args.threads} threads, LogIX from {args.logix_python}")
    rows = [row for name in args.tasks.split(",") if name for row in compare(name, args)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
