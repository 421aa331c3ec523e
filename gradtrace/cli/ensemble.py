"""Ensembles on the command line: ``gradtrace score STORE QUERIES --store STORE_2 ... --model MODEL_1 --model MODEL_2``.

For a single-checkpoint method (``grad_dot``, ``grad_cos``, ``kfac``, ``ekfac``, ``ggn``, ``logra``, ``trak``,
``trackstar``), further ``--store`` s make an ensemble (:class:`gradtrace.Ensemble`): one member per store, each
collected at its own checkpoint or independently trained model, the queries' gradients taken with that member's
``--model`` (default: the model each store records), a fit per member for the fitted methods (``--curvature`` for
STORE, ``--member-curvature`` for each further store, in order: ``gradtrace fit`` each store with its model --
and for trackstar its own checkpoint's ``--optimizer``), each member's scores divided by their mean absolute value
and combined with ``--ensemble-weights`` (default equal).
Cost: C x the collection, C x the fit, 2 C x the scoring products of one model.

With several stores (an ensemble, or tracin's checkpoints) ``--generate`` answers the query prompts with one
model, the model being explained, and every member's query gradients are taken on those answers
(:func:`answering_model`): ``--answer-model MODEL_DIR`` (one of the stores' models); else the latest checkpoint
when every model is a Trainer ``checkpoint-N`` directory of one run (the highest ``N``; an early checkpoint's
answers are not the trained model's); else STORE's model. The output and the saved configuration name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .commands import Group, cli
from .errors import CliError
from .score_fit import needs_fit

__all__ = ["EnsembleOptions", "answering_model", "check_ensemble", "is_ensemble", "score_ensemble"]


@dataclass(kw_only=True)
class EnsembleOptions(Group):
    """An ensemble of one method over several stores (see :mod:`gradtrace.cli.ensemble`)."""

    panel = "Ensembles (further --store with a single-checkpoint method)"
    member_curvature: list[Path] = field(default_factory=list, metadata=cli(
        "The fit of each further --store, in order (repeat; STORE's is --curvature); kfac, ekfac, ggn, logra, "
        "trak, trackstar: gradtrace fit each store with its own --model (trackstar: and --optimizer).",
        "--member-curvature", "--member-fit", metavar="FIT_DIR"))
    ensemble_weights: list[float] = field(default_factory=list, metadata=cli(
        "Weight of each member, STORE first (repeat; default equal; normalised to sum to 1; not all 0).",
        "--ensemble-weights", metavar="W", min=0))


def is_ensemble(method: str, store_count: int) -> bool:
    """Whether the stores make an ensemble: several of them for a method that does not combine checkpoints."""
    from ..fit.methods import method_class

    return store_count > 1 and not method_class(method).multi_checkpoint


def answering_model(models: list[Path], generate: bool, given: Path | None) -> tuple[int, str]:
    """Which store's model answers the query prompts with ``--generate`` (its position in ``models``, one per
    store), and why in words (module docstring); checked before any model is loaded."""
    from .collect import latest_checkpoint, trainer_step

    if given is not None:
        if not generate:
            raise CliError("--answer-model chooses the model that answers the query prompts with --generate: pass "
                           "--generate, or drop --answer-model")
        where = [c for c, model in enumerate(models) if model.resolve() == given.resolve()]
        if not where:
            listing = ", ".join(str(m) for m in models)
            raise CliError(f"--answer-model {given} is not one of the stores' models ({listing}): the answers must "
                           "come from a model the scores explain; give one of them")
        return where[0], "--answer-model"
    if len(models) == 1:
        return 0, ""
    latest = latest_checkpoint(models)
    if latest is not None:
        return latest, f"the latest checkpoint, step {trainer_step(models[latest])}; --answer-model for another"
    return 0, "STORE's model; --answer-model for another"


def check_ensemble(method: str, opts: EnsembleOptions, store_count: int, *, curvature: Path | None,
                   index: Any, tokens: bool, world: int) -> None:
    """Refuse ensemble flags that do not fit the stores (wrong counts, flags of one-store features)."""
    from ..fit.methods import saves_fit

    ensemble = is_ensemble(method, store_count)
    if not ensemble:
        if opts.member_curvature or opts.ensemble_weights:
            raise CliError("--member-curvature/--ensemble-weights apply to an ensemble: give further --store (one "
                           f"per checkpoint or model) with a single-checkpoint method (not {method})")
        return
    count = store_count
    if opts.ensemble_weights and len(opts.ensemble_weights) != count:
        raise CliError(f"{len(opts.ensemble_weights)} --ensemble-weights for {count} stores: give one weight per "
                       "store, STORE first")
    if opts.ensemble_weights and not any(opts.ensemble_weights):  # each is >= 0 (cli.options.check_values)
        raise CliError("--ensemble-weights are all 0: give at least one member a positive weight")
    fitted = needs_fit(method)
    if fitted and (curvature is None or len(opts.member_curvature) != count - 1):
        data = "" if saves_fit(method) else " TRAIN.jsonl"
        extra = " --optimizer CHECKPOINT_c" if method == "trackstar" else ""
        raise CliError(f"--method {method} is fitted per member: pass --curvature for STORE and one "
                       f"--member-curvature per further --store ({count - 1}), each from gradtrace fit STORE_c{data} "
                       f"--model MODEL_c --method {method}{extra}; got {len(opts.member_curvature)}")
    if not fitted and opts.member_curvature:
        raise CliError("--member-curvature applies to methods fitted with gradtrace fit (kfac, ekfac, ggn, logra, "
                       f"trak, trackstar), not {method}")
    for flag, used in (("--index", index is not None), ("--tokens/--modules", tokens), ("torchrun", world > 1)):
        if used:
            raise CliError(f"{flag} is not supported for an ensemble of {count} stores: score one store, or the "
                           "ensemble in one process without it")


def score_ensemble(method: str | list[Any], stores: list[Any], query_sets: list[Any], opts: EnsembleOptions, *,
                   topk: int | None, matrix: Any, block_rows: int, device: str, progress: bool) -> tuple[Any, Any]:
    """The :class:`~gradtrace.Ensemble` and its :class:`~gradtrace.Scores` (members matched by example id; a
    mismatch is a clear error)."""
    from ..score.ensemble import Ensemble, EnsembleError

    try:
        ensemble = Ensemble(method, stores, weights=opts.ensemble_weights or None, block_rows=block_rows,
                            device=device)
        return ensemble, ensemble.score(query_sets, topk=topk, matrix=matrix, progress=progress)
    except (EnsembleError, ValueError) as err:
        raise CliError(str(err)) from None
