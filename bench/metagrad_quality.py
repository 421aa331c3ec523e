"""Metagradient quality: LDS on the bundled tasks, under the counterfactual metagradients model and under retraining.

Setup, fixed before any result was seen (issue #32, targets):

* tasks: ``digits_mlp`` and ``tinylm`` (``gradtrace.eval.tasks``, their default settings), the model attributed being
  the task's own (all the training data, seed 0);
* the run: the task's training recipe re-run beside a :class:`gradtrace.replay.RunRecorder` (the same initial
  weights, shuffles, batches and optimizer: digits_mlp fused Adam with L2, tinylm AdamW), checked bit-identical
  to the task's model (else the task is skipped with the difference);
* metagradients: ``gradtrace.replay.metagradients`` of each query's loss (the task's per-example loss, the
  outcome's sign) with respect to every training example's weight, all queries in one vectorised reverse pass,
  default checkpoint spacing. tinylm trains with PyTorch's scaled-dot-product attention, whose CPU kernel has no
  double backward: its replay runs the same weights through eager attention (``TinyLMTask.eager_model``), and the
  replay check's bound is stated as ``TOLERANCE_EAGER = 1e-3`` (relative max-abs to the recorded final weights;
  the measured difference is printed); digits_mlp uses the default bound;
* ground truths, both with the subsets of ``bench/quality.py`` (``LDSOptions`` defaults, digits_mlp 100 and
  tinylm 150 half-size subsets, subset seed 0, the same cache directory ``--cache``):
  (a) *counterfactual*: the same run with the weights of the examples outside the subset set to 0 (the same
  batches in the same order, each batch's mean still over its full size), replayed functionally -- what
  metagradients model; (b) *retraining*: the task's recipe retrained on the subset (re-batched), the ground truth
  of every other row of ``bench/quality.py``;
* rows: ``metagradients``, and for reference ``grad_dot`` and ``ekfac`` (exact gradients at the attributed model,
  default options; tinylm's ``ekfac`` on the task's model as in ``bench/quality.py``), each against both ground
  truths; LDS mean +- standard error over queries;
* cost: seconds of the training run, the recorded replay, and the metagradient call (all queries).

Variant ``tinylm_eager`` (``--tasks tinylm_eager``; added after the first run refused tinylm -- its eager replay of
the SDPA-trained weights ended 7.9e-2 away, beyond the stated bound -- and fixed before any of its results): the
tinylm recipe with eager attention throughout (training, the retraining ground truth -- its own cache,
``tinylm_eager`` -- and the replay), so that the recorded run is the one replayed; everything else as tinylm.

Metasmooth variants (declared 2026-12-03 before any of their results; issue #32; ``bench/metasmooth_tasks.py``):
MAGIC-style recipes meant to be metasmooth, each a task of its own (its own ground-truth cache, by name) whose
``train`` runs the variant recipe, so the attributed model, the retraining ground truth and the recorded run are one
recipe. Digits family: digits_mlp's data, split, pixels ``"unit"``, 1000 training images, 100 queries, 100 LDS
subsets; tinylm family: 150 subsets; ``LDSOptions`` defaults otherwise, subset seed 0; float32 throughout.

1. ``digits_mlp_smooth``: MLP 64-64-64-10 with exact (erf) GELU (``torch.nn.functional.gelu``) instead of ReLU;
   SGD momentum 0.9 (no nesterov), coupled weight_decay 1e-4; batches of 100; 30 epochs (300 steps on the full
   set); lr 0.05 with linear warmup over the first 10% of steps then cosine decay to 0 (a ``LambdaLR`` stepped
   after each optimizer step).
2. ``digits_mlp_fullbatch``: the same GELU MLP; full-batch gradient descent (one batch of the whole (sub)set per
   step, mean loss), SGD momentum 0.9, coupled weight_decay 1e-4, constant lr 0.1, 300 steps.
3. ``digits_softmax``: linear softmax regression 64 -> 10 (one ``nn.Linear``), full batch, SGD momentum 0.9,
   constant lr 0.5, coupled weight_decay 1e-3, 300 steps (a convex control).
4. ``tinylm_smooth``: tinylm with eager attention throughout (as ``tinylm_eager``), batches of 50 (4 steps per
   epoch on 200 documents), 20 epochs, AdamW lr 1e-3 with linear warmup over the first 10% of steps then cosine
   decay to 0, weight_decay 0; everything else as tinylm.

Rows for each variant: ``metagradients``, ``grad_dot``, ``ekfac`` and ``kfac`` against both ground truths (LDS
mean +- s.e.); the metasmoothness check (``gradtrace.replay.metasmoothness``, the first 10 queries, its default
scales and seed) and the costs (training run, metagradients of all queries, their ratio).

Variant ``--fraction`` (declared 2026-12-03 before any of its results; issue #32): the LDS subsets keep
``round(F * N)`` of the ``N`` training examples instead of half (``LDSOptions(fraction=F)``), because MAGIC's
reported LDS (near 1) is for small drop fractions and degrades as more data is dropped, while every row above drops
half. Run with ``F = 0.9`` (drop 10%) on digits_mlp, tinylm_eager, digits_softmax, digits_mlp_fullbatch,
digits_mlp_smooth and tinylm_smooth, and with ``F = 0.99`` (drop 1%) on digits_mlp_smooth and tinylm_smooth, each
with its task's default number of subsets, subset seed 0, the same rows and columns as above; the ground truths
are cached apart (``<task>-keep<F>``). Everything else is unchanged.

Variant ``--last`` (declared 2026-12-03 before any of its results; issue #32): truncated metagradients
(``MetagradOptions.start_step``, truncated back-propagation), because the bundled recipes are not metasmooth and
their cotangent grows step after step towards the start of the run. For each share ``s`` of ``--last`` (run with
``0.01,0.1,0.5``) a row ``metagradients, last s`` differentiates the last ``max(1, round(s * T))`` of the ``T``
steps only (``start_step = T - that``), all queries in one vectorised pass, default checkpoint spacing, against both
ground truths (the counterfactual column stays the whole-run counterfactual: every step with the weights 0); with
its seconds and the metasmoothness check of its own function (the first 10 queries, the default scales and seed,
the weights perturbed from its ``start_step`` on). Beside the full pass and the other rows, unchanged. Run on
``digits_mlp`` and ``tinylm_eager`` with ``--fraction 0.9`` and ``0.5``, and on ``digits_mlp_smooth`` with
``--fraction 0.9`` (where the whole pass already reaches 0.938: what truncation costs on a smooth run).

Variant ``--ceiling`` (declared 2026-12-03 before any of its results; issue #32): how far any method can predict
the counterfactual outcomes of a recipe that is not metasmooth. The counterfactual ground truth is computed twice
for the task's LDS subsets: as above (weights 1 in the subset, 0 outside) and with every kept example's weight
``1 + eps d_i`` (``d`` random +-1 per example, seed 1, one direction for all subsets; ``eps`` from ``--ceiling``,
run with ``1e-6``: a change of the same order as float32 rounding). The row: the per-query Spearman correlation
over subsets between the two sets of outcomes (mean +- s.e.), the LDS the exact outcomes of a world one part in a
million away would score. Run on ``digits_mlp``, ``tinylm_eager`` and ``digits_mlp_smooth`` with ``--fraction 0.9``;
nothing else of the bench runs with ``--ceiling``.

Usage::

    python bench/metagrad_quality.py                       # both tasks (~15-25 min on 2 CPU cores)
    python bench/metagrad_quality.py --tasks digits_mlp --subsets 20
    python bench/metagrad_quality.py --tasks digits_softmax,digits_mlp_fullbatch,digits_mlp_smooth,tinylm_smooth
    python bench/metagrad_quality.py --tasks digits_mlp_smooth,tinylm_smooth --fraction 0.9
    python bench/metagrad_quality.py --tasks digits_mlp,tinylm_eager --fraction 0.9 --last 0.01,0.1,0.5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from metasmooth_tasks import VARIANTS, Recipe, run_recipe

TOLERANCE_EAGER = 1e-3
DEFAULT_SUBSETS = {"digits_mlp": 100, "tinylm": 150, "tinylm_eager": 150, "digits_mlp_smooth": 100,
                   "digits_mlp_fullbatch": 100, "digits_softmax": 100, "tinylm_smooth": 150}
SMOOTHNESS_QUERIES = 10  # queries of the variants' metasmoothness check


def eager_tinylm() -> Any:
    """The tinylm task with eager attention everywhere (the ``tinylm_eager`` variant)."""
    from gradtrace.eval.tasks.tinylm import TinyLMTask

    class EagerTinyLM(TinyLMTask):
        name = "tinylm_eager"

        def new_model(self, attn_implementation: str | None = None) -> Any:
            return super().new_model(attn_implementation="eager")

    return EagerTinyLM()


class Problem:
    """One task as the replay sees it: the ids, the batch of any ids, the per-example loss, the queries."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.index = {ident: i for i, ident in enumerate(task.train_ids)}
        self.lm = task.name.startswith("tinylm")

    def rows(self, ids) -> torch.Tensor:
        return torch.tensor([self.index[i] for i in ids], dtype=torch.long)

    def batch(self, ids) -> dict[str, Any]:
        rows, task = self.rows(ids), self.task
        if self.lm:
            mask = task.train_mask[rows]
            used = int(mask.sum(1).max())
            return {"input_ids": task.train_tokens[rows, :used], "attention_mask": mask[:, :used]}
        return {"x": task.x_train[rows], "y": task.y_train[rows]}

    def loss(self, forward, batch) -> torch.Tensor:
        """Per-example losses ``[B]`` whose mean is the task's batch loss."""
        from gradtrace.loss import causal_lm_loss

        if self.lm:
            return causal_lm_loss(forward, batch)
        return F.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    def queries(self) -> list[dict[str, Any]]:
        task = self.task
        if self.lm:
            return [{"input_ids": task.query_tokens[q:q + 1], "attention_mask": task.query_mask[q:q + 1]}
                    for q in range(task.num_queries)]
        return [{"x": task.x_query[q:q + 1], "y": task.y_query[q:q + 1]} for q in range(task.num_queries)]

    def query_loss(self, forward, query) -> torch.Tensor:
        return self.loss(forward, query)[0]


def recipe_of(task: Any, problem: Problem) -> Recipe:
    """The task's training recipe: a variant's own (``task.recipe()``), or the bundled tasks' (as they train)."""
    if hasattr(task, "recipe"):
        return task.recipe()
    cfg = task.settings
    if problem.lm:
        return Recipe(lambda: task.new_model(),
                      lambda params: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
                      lambda model, rows: problem.loss(model, problem.batch([task.train_ids[i] for i in rows])).mean(),
                      cfg.batch_size, cfg.epochs)
    from gradtrace.eval.tasks.digits_mlp import DigitsReLUMLP

    return Recipe(lambda: DigitsReLUMLP(cfg.width, cfg.depth),
                  lambda params: torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True),
                  lambda model, rows: F.cross_entropy(model(task.x_train[rows]), task.y_train[rows]),
                  cfg.batch_size, cfg.epochs)


def record(task: Any, problem: Problem, run_dir: Path) -> tuple[Any, float]:
    """The task's training of its attributed model, again, recorded: its recipe (model factory, optimizer, scheduler,
    batch size, epochs) run by ``run_recipe`` (``minibatch_epochs``'s loop) beside a ``RunRecorder``."""
    from gradtrace.replay import Reduction, RunRecorder

    held: dict[str, Any] = {}

    def start(model: Any, optimizer: Any, scheduler: Any) -> Any:
        recorder = RunRecorder(run_dir, model, optimizer, scheduler=scheduler, reduction=Reduction(kind="mean"))
        held.update(recorder=recorder, began=time.perf_counter())
        return lambda rows: recorder.step([task.train_ids[i] for i in rows.tolist()])

    model = run_recipe(recipe_of(task, problem), torch.arange(task.num_train), task.settings.seed, on_start=start)
    seconds = time.perf_counter() - held["began"]
    held["recorder"].finish(model)
    return model, seconds


def counterfactual_truth(run: Any, model: Any, problem: Problem, masks: torch.Tensor, tolerance: float | None,
                         scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, Q]``: ``-loss`` of each query after the recorded run with the weights outside each subset set to 0 (and
    those inside to ``scale`` when given: the ``--ceiling`` variant)."""
    from gradtrace.replay import replay
    from gradtrace.replay.step import StepFunction

    steps = StepFunction(run, model, problem.loss, problem.batch)
    queries = problem.queries()
    ids = problem.task.train_ids
    out = []
    for mask in masks:
        kept = mask.to(torch.float64) if scale is None else mask.to(torch.float64) * scale
        weights = {ident: float(keep) for ident, keep in zip(ids, kept.tolist())}
        state = replay(run, model, problem.loss, problem.batch, weights=weights, tolerance=tolerance).state
        forward = steps.forward(state.params)
        with torch.no_grad():
            out.append(torch.stack([-problem.query_loss(forward, q).to(torch.float64) for q in queries]))
    return torch.stack(out)


def task_of(name: str) -> Any:
    from gradtrace.eval.tasks import get_task

    return eager_tinylm() if name == "tinylm_eager" else VARIANTS[name]() if name in VARIANTS else get_task(name)


def run_ceiling(name: str, args: argparse.Namespace) -> None:
    """The ``--ceiling`` variant: Spearman correlation of the counterfactual outcomes with those of weights
    ``1 + eps d`` in every subset."""
    from gradtrace.eval.groundtruth import subset_masks
    from gradtrace.eval.metrics import summarize
    from gradtrace.grad.quantize import spearman
    from gradtrace.options import LDSOptions
    from gradtrace.replay import load_run

    task = task_of(name)
    problem = Problem(task)
    subsets = args.subsets or DEFAULT_SUBSETS[name]
    masks = subset_masks(task.num_train, subsets, args.fraction, LDSOptions().seed)  # the LDS subsets (seed 0)
    direction = torch.randint(0, 2, (task.num_train,), generator=torch.Generator().manual_seed(1)) * 2 - 1
    print(f"\n### {name}: chaos ceiling at eps = {args.ceiling:g} (subsets keep {args.fraction:g})")
    with tempfile.TemporaryDirectory() as tmp:
        recorded, _ = record(task, problem, Path(tmp) / "run")
        run = load_run(Path(tmp) / "run")
        began = time.perf_counter()
        plain = counterfactual_truth(run, recorded, problem, masks, None)
        moved = counterfactual_truth(run, recorded, problem, masks, None, scale=1 + args.ceiling * direction)
    rho = summarize(spearman(moved.t().contiguous(), plain.t().contiguous()))
    changed = (moved != plain).to(torch.float64).mean().item()
    print(f"Spearman(outcomes at 1 + eps d, outcomes at 1), {subsets} subsets: {rho.mean:.3f} +- {rho.se:.3f} "
          f"(min {rho.per_query.min():.3f}, max {rho.per_query.max():.3f}); outcomes changed: {changed:.1%}; "
          f"{time.perf_counter() - began:.0f} s")


def run_task(name: str, args: argparse.Namespace) -> None:
    from gradtrace.eval import build_lds_ground_truth, lds
    from gradtrace.eval.benchmark import evaluate
    from gradtrace.eval.groundtruth import GroundTruth
    from gradtrace.options import LDSOptions, MetagradOptions
    from gradtrace.replay import MetaGradients, load_run, metagradients, metasmoothness

    task = task_of(name)
    problem = Problem(task)
    subsets = args.subsets or DEFAULT_SUBSETS[name]
    cache = name if args.fraction == 0.5 else f"{name}-keep{args.fraction:g}"
    print(f"\n### {name}" + ("" if args.fraction == 0.5 else f" (subsets keep {args.fraction:g} of the data)")
          + f"\n\n{task.describe()}")
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, cache=Path(args.cache) / cache,
                                   config=task.config, options=LDSOptions(num_subsets=subsets,
                                                                          fraction=args.fraction))
    with tempfile.TemporaryDirectory() as tmp:
        recorded, train_seconds = record(task, problem, Path(tmp) / "run")
        reference = task.model
        diff = max(float((a - b).abs().max()) for a, b in zip(recorded.state_dict().values(),
                                                               reference.state_dict().values()))
        if diff != 0.0:
            print(f"skipped: the recorded run ends {diff:.3g} away from the task's model (not bit-identical)")
            return
        run = load_run(Path(tmp) / "run")
        replay_model = task.eager_model() if name == "tinylm" else recorded  # tinylm_eager: trained eager
        tolerance = TOLERANCE_EAGER if name == "tinylm" else None
        began = time.perf_counter()
        result = metagradients(run, replay_model, problem.loss, problem.batch, problem.queries(), problem.query_loss,
                               train_ids=task.train_ids, options=MetagradOptions(tolerance=tolerance))
        metagrad_seconds = time.perf_counter() - began
        began = time.perf_counter()
        counterfactual = GroundTruth(truth.masks, counterfactual_truth(run, replay_model, problem, truth.masks,
                                                                       tolerance), {"kind": "counterfactual"})
        truth_seconds = time.perf_counter() - began
        truncated = {}
        for share in args.last:
            start = len(run.steps) - max(1, round(share * len(run.steps)))
            began = time.perf_counter()
            cut = metagradients(run, replay_model, problem.loss, problem.batch, problem.queries(), problem.query_loss,
                                train_ids=task.train_ids, options=MetagradOptions(tolerance=tolerance,
                                                                                  start_step=start))
            seconds = time.perf_counter() - began
            head = MetaGradients(cut.scores[:SMOOTHNESS_QUERIES], cut.ids, cut.query_losses[:SMOOTHNESS_QUERIES],
                                 cut.replay_difference, cut.checkpoint_every, start_step=start)
            check = metasmoothness(run, replay_model, problem.loss, problem.batch,
                                   problem.queries()[:SMOOTHNESS_QUERIES], problem.query_loss, result=head,
                                   options=MetagradOptions(tolerance=tolerance))
            truncated[f"metagradients, last {share:g}"] = (cut.scores, start, seconds, check)
        smooth = None
        if name in VARIANTS:  # the check on the first queries, reusing their metagradients
            count = SMOOTHNESS_QUERIES
            head = MetaGradients(result.scores[:count], result.ids, result.query_losses[:count],
                                 result.replay_difference, result.checkpoint_every)
            smooth = metasmoothness(run, replay_model, problem.loss, problem.batch, problem.queries()[:count],
                                    problem.query_loss, result=head, options=MetagradOptions(tolerance=tolerance))
    print(f"training run {train_seconds:.1f} s; metagradients of {task.num_queries} queries {metagrad_seconds:.1f} s "
          f"({metagrad_seconds / train_seconds:.1f}x the training run); replay difference to the recorded weights "
          f"{result.replay_difference:.2e}; counterfactual ground truth {truth_seconds:.0f} s for {subsets} subsets")
    rows = {"metagradients": result.scores}
    for label, (scores, start, seconds, _) in truncated.items():
        rows[label] = scores
        print(f"{label}: steps {start}..{len(run.steps) - 1} of {len(run.steps)}, {seconds:.1f} s "
              f"({seconds / train_seconds:.1f}x the training run)")
    for method in ("grad_dot", "ekfac") + (("kfac",) if name in VARIANTS else ()):
        row = evaluate(task, [method], truth)[0]
        rows[method] = row  # scores are re-derived below for the counterfactual column
    print("\n| method | LDS, counterfactual (same run, weights 0) | LDS, retraining on the subset |")
    print("|---|---|---|")
    for method, value in rows.items():
        if isinstance(value, torch.Tensor):
            a, b = lds(value, counterfactual.masks, counterfactual.outcomes), lds(value, truth.masks, truth.outcomes)
        else:
            b = value.lds
            a = evaluate(task, [method], counterfactual)[0].lds
        print(f"| {method} | {a.mean:.3f} +- {a.se:.3f} | {b.mean:.3f} +- {b.se:.3f} |")
    for label, (_, start, _, check) in truncated.items():
        print(f"\nmetasmoothness of {label} (its own function: weights perturbed from step {start}; "
              f"{SMOOTHNESS_QUERIES} queries):\n")
        print("| eps | relative error of the linear prediction | sign agreement |\n|---|---|---|")
        for eps, error, agree in zip(check.scales, check.relative_error, check.sign_agreement):
            print(f"| {eps:g} | {error:.3g} | {agree:.2f} |")
    if smooth is not None:
        print(f"\nmetasmoothness ({SMOOTHNESS_QUERIES} queries, one random +-1 direction):\n")
        print("| eps | relative error of the linear prediction | sign agreement |\n|---|---|---|")
        for eps, error, agree in zip(smooth.scales, smooth.relative_error, smooth.sign_agreement):
            print(f"| {eps:g} | {error:.3g} | {agree:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="digits_mlp,tinylm")
    parser.add_argument("--subsets", type=int, default=None, help="LDS subsets (default: bench/quality.py's)")
    parser.add_argument("--cache", default=".cache/gradtrace-quality", help="ground-truth cache (bench/quality.py's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.5, help="share of the training set each LDS subset "
                        "keeps (default 0.5; the --fraction variant: 0.9, 0.99)")
    parser.add_argument("--last", type=lambda text: [float(x) for x in text.split(",")], default=[],
                        help="shares of the steps for truncated metagradient rows (the --last variant: 0.01,0.1,0.5)")
    parser.add_argument("--ceiling", type=float, default=None, help="the --ceiling variant: eps of the perturbed "
                        "counterfactual outcomes (1e-6); nothing else runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.tasks.split(","):
        (run_ceiling if args.ceiling is not None else run_task)(name, args)


if __name__ == "__main__":
    main()
