"""Ensembles on the command line: ``gradtrace score STORE QUERIES --store STORE_2 ... --model MODEL_1 --model MODEL_2``.

For a single-checkpoint method (``grad_dot``, ``grad_cos``, ``kfac``, ``ekfac``, ``ggn``, ``logra``), further
``--store`` s make an ensemble (:class:`gradtrace.Ensemble`): one member per store, each collected at its own
checkpoint or independently trained model, the queries' gradients taken with that member's ``--model`` (default:
the model each store records), a curvature per member for the curvature methods (``--curvature`` for STORE,
``--member-curvature`` for each further store, in order: ``gradtrace fit`` each store with its model), each
member's scores divided by their mean absolute value and combined with ``--ensemble-weights`` (default equal).
Cost: C x the collection, C x the fit, 2 C x the scoring products of one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..methods import get_method
from .errors import CliError
from .options import Group, cli

__all__ = ["EnsembleOptions", "check_ensemble", "ensemble_methods", "is_ensemble", "score_ensemble"]


@dataclass(kw_only=True)
class EnsembleOptions(Group):
    """An ensemble of one method over several stores (see :mod:`gradtrace.cli.ensemble`)."""

    panel = "Ensembles (further --store with a single-checkpoint method)"
    member_curvature: list[Path] = field(default_factory=list, metadata=cli(
        "Fitted curvature of each further --store, in order (repeat; STORE's is --curvature); kfac, ekfac, ggn, "
        "logra: gradtrace fit each store with its own --model.", "--member-curvature", metavar="CURVATURE_DIR"))
    ensemble_weights: list[float] = field(default_factory=list, metadata=cli(
        "Weight of each member, STORE first (repeat; default equal; normalised to sum to 1).", "--ensemble-weights",
        metavar="W"))


def is_ensemble(method: str, store_count: int) -> bool:
    """Whether the stores make an ensemble: several of them for a method that does not combine checkpoints."""
    return store_count > 1 and not get_method(method).multi_checkpoint


def check_ensemble(method: str, opts: EnsembleOptions, store_count: int, *, curvature: Path | None,
                   index: Any, tokens: bool, world: int) -> None:
    """Refuse ensemble flags that do not fit the stores (wrong counts, flags of one-store features)."""
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
    needs_curvature = "curvature" in get_method(method).needs
    if needs_curvature and (curvature is None or len(opts.member_curvature) != count - 1):
        raise CliError(f"--method {method} fits curvature per member: pass --curvature for STORE and one "
                       f"--member-curvature per further --store ({count - 1}), each from gradtrace fit STORE_c "
                       f"TRAIN.jsonl --model MODEL_c --method {method}; got {len(opts.member_curvature)}")
    if not needs_curvature and opts.member_curvature:
        raise CliError(f"--member-curvature applies to curvature methods (kfac, ekfac, ggn, logra), not {method}")
    for flag, used in (("--index", index is not None), ("--tokens/--modules", tokens), ("torchrun", world > 1)):
        if used:
            raise CliError(f"{flag} is not supported for an ensemble of {count} stores: score one store, or the "
                           "ensemble in one process without it")
    for path in opts.member_curvature:
        if not (path / "curvature.json").exists():
            raise CliError(f"--member-curvature {path} holds no fitted curvature (curvature.json missing)")


def ensemble_methods(method: str, options: dict[str, Any], curvature: Path | None,
                     opts: EnsembleOptions) -> str | list[Any]:
    """The ensemble's method: the name, or one instance per member with its own curvature."""
    if "curvature" not in options:
        return method
    settings = {k: v for k, v in options.items() if k != "curvature"}
    return [get_method(method, curvature=path, **settings) for path in [curvature, *opts.member_curvature]]


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
