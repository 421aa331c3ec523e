"""Attribution quality: the LDS of every method the harness can run, on small tasks with a retraining ground truth.

Tasks (``gradtrace.eval.tasks``):

* ``digits`` -- an MLP 64-32(tanh)-10 on 1,000 scikit-learn 8x8 digit images (each pixel standardised), 100
  held-out query images;
* ``digits_mlp`` -- the same images (pixels scaled to [0, 1]) and queries, an MLP 64-64-64-10 (ReLU) trained to
  near convergence with mini-batch Adam (100 epochs, L2 1e-4), the literature's MLP-on-MNIST setup at digits
  scale;
* ``tinylm`` -- a one-layer GPT-2 (width 64) on 200 Shakespeare documents of 20 words, 20 held-out documents.

For each task the LDS ground truth (random half-size subsets, one retraining each, outcome = -query loss)
is built once and cached under ``--cache`` (refused and rebuilt only if the task's configuration changes:
delete the directory). Every method in ``gradtrace.available_methods()`` that the harness can run is
scored with default options on exact per-example gradients at the model trained on all the data (``logra``
and ``trak`` on LoGra-projected ones, ``--rank``), plus a ``random`` baseline; the others are listed with the reason.
``trackstar`` needs the optimizer's second moment at the attributed weights, which the tasks do not keep: the harness
trains the task's model once more with ``torch.optim.Adam`` / ``AdamW`` recorded, checks that the weights are
bit-identical to the task's model (else the row is skipped with the reason) and fits with that optimizer's
``state_dict()``; it is scored on exact gradients (the normalisation is then TrackStar's exactly) and on LoGra
rank ``--rank`` ones (the second moment mapped into the projection; the paper's setting is projected). Its
preconditioned variants follow (``TRACKSTAR_PRECONDITIONED``, with the method's default damping, fixed before any
of their results): ``precondition="autocorrelation"`` (TrackStar's own ``R``, the second moment of the normalised
training gradients) on exact gradients -- refused by the method beyond 32,768 dimensions (tinylm), which the
table's notes then say -- and on LoGra rank ``--rank`` ones (the paper's setting), and ``precondition="ekfac"``
on exact gradients. Added later and fixed before any of its results: the autocorrelation per parameter
(``structure="parameter"``, Bergson's per-module form), on exact and on LoGra rank ``--rank`` gradients; its exact
row is skipped, with the reason in the notes, where its float64 kernels would not fit the available memory
(planned from the parameters' sizes before any fit: tinylm's 32,768-entry embedding alone takes 8 GiB, with the
eigensolver's workspace 32 GiB).
On tinylm, ``arnoldi`` and ``cg`` (whose Gauss-Newton products need a forward-mode derivative, which the GPT-2's
CPU scaled-dot-product attention lacks) run on ``TinyLMTask.eager_model()``: the trained weights in an
eager-attention copy (training with eager attention would end at other weights than the ground truth's recipe).
Prints one markdown table per task (LDS mean ± standard error over queries, and fit + score seconds).

Ensembles (``--ensembles``, on ``digits_mlp`` and ``tinylm``, for ``grad_dot``, ``logra``, ``trak``, ``kfac``,
``ekfac`` and ``trackstar``; ``trak`` and then ``trackstar`` added after the others' rows were published, with the
same members and normalisation):
the same method as an ensemble of ``MEMBERS = 6`` models -- ``checkpoints``: the task's own training run (all the
data, seed 0) saved after epochs ``round(k * epochs / 6)``, k = 1..6 (digits_mlp 17, 33, 50, 67, 83, 100;
tinylm 3, 7, 10, 13, 17, 20), the last being the attributed model; ``seeds``: 6 models trained on all the data
with seeds 0..5, the first being the attributed model. Each member's gradients are collected and its method
fitted at its own weights; scores are combined with equal weights after dividing each member's score matrix by
its mean absolute value (``gradtrace.Ensemble``'s default). The ground truth is the unchanged one (retraining
from the task's recipe, seed 0). Each ensemble row is followed by its paired difference to the single model.
``trackstar``'s members each take the Adam state of their own training at their weights (``member_options``),
from a replay of the members' training with the optimizer recorded, checked bit-identical to the members (else
the rows are skipped with the reason); exact gradients, no preconditioning, as its single-model row.

Variant ``late_checkpoints`` (``--ensembles late_checkpoints``; not in the default kinds), added after the
``checkpoints`` rows missed the issue's target on tinylm and fixed before any of its results: the same run's
``MEMBERS`` checkpoints evenly spaced over its second half (``Task.checkpoints(6, after=0.5)``: digits_mlp after
epochs 58, 67, 75, 83, 92, 100; tinylm 12, 13, 15, 17, 18, 20), everything else as ``checkpoints``. It tests the
reading that the first checkpoints, far from the attributed model, dilute the equal-weight average.
``--members-alone`` also prints the LDS of each member's model alone (the members are trained once more).

Variant ``unrolled`` (``--ensembles unrolled``; not in the default kinds), for ``kfac`` and ``ekfac``, added after
the ``checkpoints`` and ``late_checkpoints`` rows missed the issue's target on tinylm, and fixed (here, before any of
its results) as the method defines it with no setting chosen by the harness: the ``checkpoints`` members (the same
six checkpoints, gradients and curvature fits) combined by ``gradtrace.Unrolled`` -- segment ``c`` is the
``(epoch_c - epoch_{c-1}) x ceil(N / batch_size)`` optimizer steps up to checkpoint ``c`` at the task's constant
learning rate, each checkpoint's step scale is read from the Adam state of its own training (the replay checked
bit-identical, as for ``trackstar``), the damping is the method's default, and the query gradients are the
attributed model's. No per-member normalisation or weight. Its first run took each layer's Adam step scale as the
plain mean of ``1 / (sqrt(v_hat) + eps)``; its results showed that mean decided by coordinates that get no gradient
(tinylm's position embeddings and attention: horizons of 10^4-10^5), a flaw of the approximation found in the
horizons, not in the LDS. The method's default became the trace-matched scale (``step_scale="trace"``, see
``gradtrace.score.unrolled``), fixed before any of its results; ``--ensembles unrolled`` runs it and
``--ensembles unrolled_mean`` the first definition, both reported. Both stayed below the attributed model's own
``kfac`` / ``ekfac`` on tinylm; their horizons showed most eigen-directions with ``t x << 1`` -- a layer's single
step scale cannot give flat directions the large steps Adam gives their coordinates -- so a third definition,
``step_scale="eigenbasis"`` (the diagonal of Adam's preconditioner in each curvature eigenbasis, one horizon per
direction), was added and fixed before any of its results: ``--ensembles unrolled_eigenbasis``. All three are
reported. Because three definitions were tried against one ground truth, each is also scored on a confirmation
ground truth drawn on other subsets (``--subset-seed 1``: the same recipe, training seeds and size; built after
the three were fixed), with the single-model and ``checkpoints`` rows next to them.

    python bench/quality.py                       # every task, all methods (builds the cache the first time)
    python bench/quality.py --tasks digits --methods grad_dot,kfac,random --subsets 50
    python bench/quality.py --tasks digits_mlp,tinylm --methods grad_dot,logra,kfac,ekfac --ensembles checkpoints,seeds
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

import gradtrace
from gradtrace.eval import (
    RANDOM,
    GroundTruth,
    MethodSpec,
    Row,
    build_lds_ground_truth,
    evaluate,
    format_table,
    get_task,
    unsupported,
)
from gradtrace.eval.benchmark import CHECKPOINTS_AFTER, ENSEMBLES, ensemble_models
from gradtrace.options.eval import LDSOptions
from gradtrace.plan.resources import available_memory

DEFAULT_SUBSETS = {"digits": 100, "digits_mlp": 100, "tinylm": 150}
PROJECTED = {"logra", "trak"}  # methods that score LoGra-projected gradients
ORDER = ["grad_dot", "grad_cos", "tracin", "less", "dvemb", "logra", "trak", "trackstar", "kfac", "ekfac", "ggn",
         "arnoldi", "cg", "ggn_full"]  # table order
ADAM = {"trackstar"}  # methods fitted with the optimizer state of the attributed model (see the module docstring)
SKIP = {  # (task, method): why the harness does not run it there
    ("tinylm", "ggn"): "the dense per-parameter Fisher (blocks up to 65,536 entries) includes the 32,768-entry "
                       "embedding matrix; fitting it was killed at 23 GB of memory on this machine",
    ("tinylm", "ggn_full"): "the dense matrix of all 87k parameters would take 2 x 87k^2 x 8 bytes = 113 GiB",
}
# methods whose Gauss-Newton products need a forward-mode derivative, which the GPT-2's CPU scaled-dot-product
# attention lacks: on tinylm they run on the trained model's eager-attention copy (the same weights,
# TinyLMTask.eager_model); training and the ground truth keep the default attention
FORWARD_MODE = {"arnoldi", "cg"}


class _WithModel:
    """``task`` with :attr:`model` replaced (everything else is the task's)."""

    def __init__(self, task, model: torch.nn.Module) -> None:
        self._task = task
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self._task, name)


# TrackStar's preconditioned variants, (precondition, on LoGra-projected gradients?), each a row after the plain
# ones; added after the plain rows were published and fixed before any of their results (module docstring)
TRACKSTAR_PRECONDITIONED = (("autocorrelation", False, "joint"), ("autocorrelation", True, "joint"),
                            ("ekfac", False, "joint"),
                            # added later, fixed before any of its results: the autocorrelation per parameter
                            ("autocorrelation", False, "parameter"), ("autocorrelation", True, "parameter"))

MEMBERS = 6  # models per ensemble (fixed before any ensemble LDS was seen)
ENSEMBLE_TASKS = ("digits_mlp", "tinylm")  # tasks with an epoch schedule to take checkpoints along
ENSEMBLE_METHODS = ("grad_dot", "logra", "trak", "kfac", "ekfac", "trackstar")
# the checkpoints' members combined by gradtrace.Unrolled, by kind: its step_scale (module docstring)
UNROLLED = {"unrolled": "trace", "unrolled_mean": "mean", "unrolled_eigenbasis": "eigenbasis"}
UNROLLED_METHODS = ("kfac", "ekfac")
KINDS = (*ENSEMBLES, *UNROLLED)  # what --ensembles takes
ENSEMBLE_LABELS = {"checkpoints": f"{MEMBERS} checkpoints of one run",
                   "unrolled": f"{MEMBERS} checkpoints of one run, unrolled",
                   "unrolled_mean": f"{MEMBERS} checkpoints of one run, unrolled (step_scale=mean)",
                   "unrolled_eigenbasis": f"{MEMBERS} checkpoints of one run, unrolled (step_scale=eigenbasis)",
                   "late_checkpoints": f"{MEMBERS} checkpoints of the second half of one run",
                   "seeds": f"{MEMBERS} models, seeds 0-5"}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _subsets(text: str | None, tasks: list[str]) -> dict[str, int]:
    counts = {t: DEFAULT_SUBSETS.get(t, 100) for t in tasks}
    if text:
        for part in text.split(","):
            name, _, value = part.rpartition("=")
            if name:
                counts[name] = int(value)
            else:
                counts = dict.fromkeys(tasks, int(value))
    return counts


@contextlib.contextmanager
def _recording_adam():
    """Within the block, every ``torch.optim.Adam`` / ``AdamW`` built is appended to the yielded list."""
    made: list[torch.optim.Optimizer] = []
    originals = torch.optim.Adam, torch.optim.AdamW

    def recorded(base: type) -> type:
        class Recorded(base):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

        Recorded.__name__ = Recorded.__qualname__ = base.__name__
        return Recorded

    torch.optim.Adam, torch.optim.AdamW = recorded(originals[0]), recorded(originals[1])
    try:
        yield made
    finally:
        torch.optim.Adam, torch.optim.AdamW = originals


def adam_state(task) -> tuple[dict | None, str]:
    """``(state_dict, "")`` of the optimizer that trained ``task.model``, from a replay of its training checked
    bit-identical; ``(None, why)`` when it cannot be had."""
    with _recording_adam() as made:
        model = task.train(torch.arange(task.num_train), task.settings.seed)
    if len(made) != 1:
        return None, f"its training built {len(made)} Adam optimizers (one expected)"
    replay, kept = model.state_dict(), task.model.state_dict()
    if replay.keys() != kept.keys() or not all(torch.equal(replay[k], kept[k]) for k in kept):
        return None, "a replay of the task's training did not reproduce its model bit for bit"
    return made[0].state_dict(), ""


def member_adam_states(task, kind: str, count: int) -> tuple[list[dict] | None, str]:
    """``(states, "")``: per member of the ensemble ``kind``, the ``state_dict`` of the Adam optimizer that trained
    it, at its weights, from a replay of the members' training checked bit-identical to the members;
    ``(None, why)`` when it cannot be had."""
    everything, states, replayed = torch.arange(task.num_train), [], []
    if kind in CHECKPOINTS_AFTER:
        at = set(task.checkpoint_epochs(count, after=CHECKPOINTS_AFTER[kind]))
        with _recording_adam() as made:
            def keep(epoch: int, model: torch.nn.Module) -> None:
                if epoch in at:
                    replayed.append({k: v.clone() for k, v in model.state_dict().items()})
                    states.append(copy.deepcopy(made[-1].state_dict()))

            task.train(everything, task.settings.seed, on_epoch=keep)
        built = [len(made)]
    else:
        built = []
        for offset in range(count):
            with _recording_adam() as made:
                replayed.append(task.train(everything, task.settings.seed + offset).state_dict())
            states.append(made[-1].state_dict() if made else None)
            built.append(len(made))
    wrong = [n for n in built if n != 1]
    if wrong:
        return None, f"a member's training built {wrong[0]} Adam optimizers (one expected)"
    members = ensemble_models(task, kind, count)
    if len(replayed) != len(members):
        return None, f"the replay saved {len(replayed)} members, the ensemble has {len(members)}"
    for c, (replay, member) in enumerate(zip(replayed, members)):
        kept = member.state_dict()
        if replay.keys() != kept.keys() or not all(torch.equal(replay[k], kept[k]) for k in kept):
            return None, f"a replay of member {c}'s training did not reproduce its weights bit for bit"
    return states, ""


def _kernels_fit(model, projected: bool) -> str | None:
    """Why trackstar's per-parameter autocorrelation of ``model``'s exact gradients cannot be fitted here (None when
    it can): its float64 kernels and the widest one's eigendecomposition, ``8 (sum D_p^2 + 3 max D_p^2)`` bytes (as
    ``gradtrace.plan_fit`` plans it), beyond the available memory. Decided from the sizes, before any fit."""
    if projected or model is None:
        return None
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    need, have = 8 * (sum(s * s for s in sizes) + 3 * max(sizes) ** 2), available_memory()
    if have is not None and need > have:
        return (f"its kernels take {need / 2**30:.1f} GiB (float64; widest parameter {max(sizes):,} dims), beyond "
                f"the {have / 2**30:.1f} GiB available")
    return None


def _specs(task: str, names: list[str], rank: int, optimizer: tuple[dict | None, str] | None = None,
           model=None) -> tuple[list[MethodSpec], list[str]]:
    specs, notes = [], []
    for name in names:
        reason = SKIP.get((task, name)) or unsupported(name)
        if reason is None and name in ADAM and optimizer is not None and optimizer[0] is None:
            reason = f"no Adam state: {optimizer[1]}"
        if reason is not None:
            notes.append(f"`{name}` skipped: {reason}")
            continue
        fit_options = {"optimizer": optimizer[0]} if name in ADAM and optimizer is not None else {}
        projection = gradtrace.LoGra(rank=rank) if name in PROJECTED else None
        label = f"{name} (LoGra rank {rank})" if name in PROJECTED else name
        specs.append(MethodSpec(name, projection=projection, label=label, fit_options=fit_options))
        if name in ADAM:  # also on projected gradients, the paper's setting
            specs.append(MethodSpec(name, projection=gradtrace.LoGra(rank=rank), fit_options=fit_options,
                                    label=f"{name} (LoGra rank {rank}, second moment mapped into it)"))
        if name == "trackstar":  # the preconditioned variants (TRACKSTAR_PRECONDITIONED)
            for precondition, projected, structure in TRACKSTAR_PRECONDITIONED:
                where = f"LoGra rank {rank}, " if projected else ""
                options = {"precondition": precondition}
                label = f"{name} ({where}precondition={precondition})"
                if structure != "joint":
                    options["structure"] = structure
                    label = f"{name} ({where}precondition={precondition}, structure={structure})"
                    too_large = _kernels_fit(model, projected)
                    if too_large:
                        notes.append(f"`{label}` skipped: {too_large}")
                        continue
                specs.append(MethodSpec(name, options=options, fit_options=fit_options,
                                        projection=gradtrace.LoGra(rank=rank) if projected else None, label=label))
    return specs, notes


def _ensemble_specs(task, names: list[str], rank: int, kinds: list[str], notes: list[str] | None = None
                    ) -> list[tuple[MethodSpec, str]]:
    """The ensemble rows of ``task``: ``(spec, title of the single-model row it is compared with)``; the Adam
    methods' members carry their own optimizer states (a kind without them is skipped, the reason in ``notes``)."""
    if task.name not in ENSEMBLE_TASKS:
        return []
    out = []
    for kind in kinds:
        if kind in UNROLLED:
            out += _unrolled_specs(task, names, rank, kind, notes)
            continue
        states: tuple[list[dict] | None, str] | None = None
        for name in (n for n in names if n in ENSEMBLE_METHODS):
            single, _ = _specs(task.name, [name], rank)
            member_options = None
            if name in ADAM:
                states = states or member_adam_states(task, kind, MEMBERS)
                if states[0] is None:
                    if notes is not None:
                        notes.append(f"`{name}`, ensemble of {ENSEMBLE_LABELS[kind]} skipped: {states[1]}")
                    continue
                member_options = [{"optimizer": state} for state in states[0]]
            projection = single[0].projection
            label = f"{single[0].title}, ensemble of {ENSEMBLE_LABELS[kind]}"
            out.append((MethodSpec(name, projection=projection, label=label, ensemble=kind, members=MEMBERS,
                                   member_options=member_options), single[0].title))
    return out


def _kind(spec: MethodSpec) -> str:
    """The ensemble kind a row belongs to (its ``--ensembles`` name)."""
    if spec.unrolled is None:
        return spec.ensemble
    return next(kind for kind, scale in UNROLLED.items() if scale == spec.unrolled["step_scale"])


def _unrolled_specs(task, names: list[str], rank: int, kind: str, notes: list[str] | None
                    ) -> list[tuple[MethodSpec, str]]:
    """The rows of an unrolled ``kind`` (module docstring): the ``checkpoints`` members, each segment's steps at the
    task's learning rate, each checkpoint's own Adam state, the kind's step scale."""
    chosen = [n for n in names if n in UNROLLED_METHODS]
    if not chosen:
        return []
    states, why = member_adam_states(task, "checkpoints", MEMBERS)
    if states is None:
        if notes is not None:
            notes.append(f"the {ENSEMBLE_LABELS[kind]} rows skipped: {why}")
        return []
    epochs = task.checkpoint_epochs(MEMBERS)
    per_epoch = math.ceil(task.num_train / task.settings.batch_size)
    steps = [(end - start) * per_epoch for start, end in zip([0, *epochs[:-1]], epochs)]
    settings = {"steps": steps, "lr": task.settings.lr, "optimizers": states, "step_scale": UNROLLED[kind]}
    out = []
    for name in chosen:
        single, _ = _specs(task.name, [name], rank)
        label = f"{single[0].title}, {ENSEMBLE_LABELS[kind]}"
        out.append((MethodSpec(name, projection=single[0].projection, label=label, ensemble="checkpoints",
                               members=MEMBERS, unrolled=settings), single[0].title))
    return out


def _paired(rows: list[Row], pairs: list[tuple[str, str]]) -> list[str]:
    """``ensemble - single`` LDS per query, mean ± paired standard error, for every (ensemble, single) pair run."""
    by_title = {row.method: row for row in rows}
    lines = []
    for ensemble, single in pairs:
        if ensemble in by_title and single in by_title and by_title[ensemble].lds and by_title[single].lds:
            diff = by_title[ensemble].lds.per_query - by_title[single].lds.per_query
            diff = diff[torch.isfinite(diff)]
            se = float(diff.std() / diff.numel() ** 0.5) if diff.numel() > 1 else float("nan")
            lines.append(f"`{ensemble}` - `{single}`: {float(diff.mean()):+.3f} ± {se:.3f} (paired over queries)")
    return lines


def _members_alone(task, all_ensembles: list[tuple[MethodSpec, str]], args: argparse.Namespace,
                   truth: GroundTruth) -> list[str]:
    """A markdown table per ensemble kind: the LDS of each member's model alone, for each ensemble method
    (``all_ensembles``: :func:`_ensemble_specs`' rows, whose Adam states the members reuse)."""
    lines = []
    for kind in args.ensemble_kinds:
        if kind in UNROLLED:  # its members are the checkpoints' (that kind's table)
            continue
        ensembles = [(spec, single) for spec, single in all_ensembles if _kind(spec) == kind]
        if not ensembles:
            continue
        attributed = 1 if kind == "seeds" else MEMBERS
        lines += [f"\neach member of the {ENSEMBLE_LABELS[kind]} alone (LDS ± SE; member {attributed} is the "
                  "attributed model):\n",
                  "| member | " + " | ".join(f"`{single}`" for _, single in ensembles) + " |",
                  "|---|" + "---|" * len(ensembles)]
        for k, model in enumerate(ensemble_models(task, kind, MEMBERS), start=1):
            specs = [MethodSpec(spec.name, projection=spec.projection, label=single,
                                fit_options=spec.member_options[k - 1] if spec.member_options else {})
                     for spec, single in ensembles]
            rows = evaluate(_WithModel(task, model), specs, truth, batch_size=args.batch_size)
            lines.append(f"| {k} | " + " | ".join(f"{row.lds_mean:.3f} ± {row.lds_se:.3f}" for row in rows) + " |")
    return lines


def run_task(name: str, args: argparse.Namespace, names: list[str], subsets: int) -> dict:
    task = get_task(name)
    began = time.perf_counter()
    model = task.model
    model_seconds = time.perf_counter() - began
    print(f"\n### {name}\n\n{task.describe()}")
    if hasattr(task, "accuracy"):
        print(f"test accuracy of the model trained on all the data: {task.accuracy(model):.1%}")
    if hasattr(task, "train_loss"):
        print(f"its mean training loss: {task.train_loss(model):.4f}")
    cache = Path(args.cache) / (name if args.subset_seed is None else f"{name}-subsets-{args.subset_seed}")
    held = GroundTruth.load(cache).num_subsets if GroundTruth.exists(cache) else 0
    truth = build_lds_ground_truth(task.train, task.outcome, task.num_train, cache=cache, config=task.config,
                                   options=LDSOptions(num_subsets=subsets, runs=args.runs, progress=args.progress,
                                                      subset_seed=args.subset_seed))
    meta = truth.meta
    state = "cached" if held >= subsets else f"{subsets - held} subsets trained now"
    print(f"ground truth: {truth.num_subsets} subsets of {meta['subset_size']} examples, {args.runs} training "
          f"run(s) each, {meta['seconds_per_model']:.2f} s per model on {meta.get('threads')} threads ({state}; "
          f"{cache}); first training on all the data: {model_seconds:.1f} s")
    optimizer = adam_state(task) if ADAM & set(names) else None
    specs, notes = _specs(name, names, args.rank, optimizer, model=task.model)
    ensembles = _ensemble_specs(task, names, args.rank, args.ensemble_kinds, notes)
    rows: list[Row] = []
    # one method at a time (one failing method hides no other); an ensemble kind's methods together (its members
    # are trained and their gradients collected once), one at a time if that fails
    groups = [[spec] for spec in specs] + [[spec for spec, _ in ensembles if _kind(spec) == kind]
                                           for kind in args.ensemble_kinds]
    eager = _WithModel(task, task.eager_model()) if hasattr(task, "eager_model") else task
    for group in (g for g in groups if g):
        on = eager if all(spec.name in FORWARD_MODE for spec in group) else task
        try:
            rows += evaluate(on, group, truth, batch_size=args.batch_size)
            continue
        except Exception as error:  # report it in the table's notes, never as a score
            if len(group) == 1:
                notes.append(f"`{group[0].title}` failed: {type(error).__name__}: {error}")
                continue
        for spec in group:
            try:
                rows += evaluate(eager if spec.name in FORWARD_MODE else task, [spec], truth,
                                 batch_size=args.batch_size)
            except Exception as error:
                notes.append(f"`{spec.title}` failed: {type(error).__name__}: {error}")
    print()
    print(format_table(rows))
    for line in _paired(rows, [(spec.title, single) for spec, single in ensembles]):
        print(f"- {line}")
    if args.members_alone:
        for line in _members_alone(task, ensembles, args, truth):
            print(line)
    for kind in args.ensemble_kinds:
        done = [row for row in rows if row.method.endswith(ENSEMBLE_LABELS[kind]) and row.members_seconds]
        if done:
            print(f"- the {ENSEMBLE_LABELS[kind]}: trained in {done[0].members_seconds:.1f} s; gradients collected "
                  f"in {', '.join(f'{row.collect_seconds:.1f}' for row in done)} s (exact / projected, per member set)")
    collected = {}
    for row in rows:
        collected.setdefault(row.dim, row.collect_seconds)
    print("\ngradients: " + "; ".join(f"{dim:,} dims collected in {sec:.2f} s" for dim, sec in collected.items()))
    for note in notes:
        print(f"- {note}")
    return {"task": name, "description": task.describe(), "config": task.config, "ground_truth": meta,
            "rows": [{"method": r.method, "lds_mean": r.lds_mean, "lds_se": r.lds_se, "seconds": r.seconds,
                      "collect_seconds": r.collect_seconds, "members_seconds": r.members_seconds, "dim": r.dim,
                      "lds_per_query": r.lds.per_query.tolist() if r.lds is not None else None} for r in rows],
            "notes": notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="digits,digits_mlp,tinylm",
                        help="comma-separated tasks (digits, digits_mlp, tinylm)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated methods (default: every available method, and random)")
    parser.add_argument("--subsets", default=None,
                        help=f"LDS subsets: N for every task or task=N,... (default {DEFAULT_SUBSETS})")
    parser.add_argument("--runs", type=int, default=1, help="training runs averaged per subset")
    parser.add_argument("--subset-seed", type=int, default=None,
                        help="draw the ground truth's subsets from this seed (training seeds unchanged; cached "
                             "apart): a confirmation ground truth on other subsets")
    parser.add_argument("--rank", type=int, default=16, help="LoGra rank of the projected methods")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per batch when collecting and fitting")
    parser.add_argument("--cache", default=".cache/gradtrace-quality", help="ground-truth cache directory")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", default=None, help="also write the results (with per-query LDS) to this file")
    parser.add_argument("--progress", action="store_true", help="progress bar while building ground truth")
    parser.add_argument("--ensembles", default="checkpoints,seeds",
                        help=f"ensemble rows on {', '.join(ENSEMBLE_TASKS)} for {', '.join(ENSEMBLE_METHODS)}: "
                             f"comma-separated kinds of {KINDS} ({', '.join(UNROLLED)}: "
                             f"{', '.join(UNROLLED_METHODS)} only), or 'none'")
    parser.add_argument("--members-alone", action="store_true",
                        help="also the LDS of each ensemble member's model alone (its members trained again)")
    args = parser.parse_args()
    args.ensemble_kinds = [] if args.ensembles == "none" else [k for k in args.ensembles.split(",") if k]
    unknown = [k for k in args.ensemble_kinds if k not in KINDS]
    if unknown:
        parser.error(f"--ensembles: unknown kinds {unknown}; use {', '.join(KINDS)} or 'none'")
    torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    known = gradtrace.available_methods()
    default = [n for n in ORDER if n in known] + [n for n in known if n not in ORDER] + [RANDOM]
    names = args.methods.split(",") if args.methods else default
    counts = _subsets(args.subsets, tasks)
    print(f"gradtrace {gradtrace.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{_cpu()} ({os.cpu_count()} cores)")
    results = [run_task(name, args, names, counts[name]) for name in tasks]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
