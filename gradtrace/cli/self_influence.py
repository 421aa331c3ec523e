"""``gradtrace self-influence STORE``: the training examples with the highest self-influence (each example scored
against itself), likely mislabeled or outlying, with their ids and texts. Further ``--store`` s (checkpoints of one
run, or other models, over the same examples) make an ensemble (:meth:`gradtrace.Ensemble.self_scores`): each
member's self-influence divided by its mean absolute value, combined with ``--ensemble-weights``."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..common.paths import why_missing
from .commands import QUIET_PROGRESS, cli, progress_flag
from .console import console
from .ensemble import EnsembleOptions, check_ensemble
from .errors import CliError
from .outputs import check_output_file
from .score_fit import load_fitted

__all__ = ["OPTIONS", "SelfInfluenceCommand", "run"]


@dataclass(kw_only=True)
class SelfInfluenceCommand:
    """Options of ``gradtrace self-influence``."""

    store: Path = field(metadata=cli("Gradient store of the training examples (written by gradtrace collect).",
                                     argument=True, metavar="STORE"))
    method: Literal["grad_dot", "kfac", "ekfac", "ggn", "logra", "trak"] = field(default="grad_dot", metadata=cli(
        "grad_dot: |g|^2; kfac, ekfac, ggn, logra: g^T H^-1 g; trak: g^T (Phi^T Phi + lambda I)^-1 g (a leverage "
        "score); all but grad_dot with --curvature (written by gradtrace fit)."))
    curvature: Path | None = field(default=None, metadata=cli(
        "What gradtrace fit saved for STORE (the curvature, or trak's fit).", "--curvature", "--fit",
        metavar="FIT_DIR"))
    damping: float | None = field(default=None, metadata=cli("Damping (default: the one saved with the fit).", min=0))
    normalize: Literal["none", "length"] = field(default="none", metadata=cli(
        "none: the gradient of each example's summed loss; length: of its mean loss per target token (the score "
        "divided by n^2 for n target tokens), so long examples do not rank high for their length alone."))
    top: int = field(default=20, metadata=cli("Examples shown (highest self-influence first).", min=1))
    out: Path | None = field(default=None, metadata=cli("Also write every example's self-influence, highest first, "
                                                        "to this .csv or .json file."))
    overwrite: bool = field(default=False, metadata=cli("Replace the --out file if it exists."))
    data: Path | None = field(default=None, metadata=cli(
        "Training data to show texts from (default: the data the store records, when it exists)."))
    width: int = field(default=70, metadata=cli("Characters of text shown per example.", min=10))
    member_stores: list[Path] = field(default_factory=list, metadata=cli(
        "Another store of the same examples, one per further checkpoint or model (repeat): an ensemble.",
        "--store", metavar="STORE"))
    ensemble_options: EnsembleOptions
    progress: bool = progress_flag(QUIET_PROGRESS)


OPTIONS = SelfInfluenceCommand


def run(opts: SelfInfluenceCommand) -> None:
    """Show the training examples with the highest self-influence (likely mislabeled or outliers).

    Example: gradtrace self-influence ./store --normalize length --top 20
    """
    import gradtrace

    from ..store import GradientStore

    if opts.out is not None and opts.out.suffix.lower() not in (".csv", ".json"):
        raise CliError(f"--out {opts.out}: write a .csv or .json file")
    if opts.out is not None:
        check_output_file(opts.out, "--out", overwrite=opts.overwrite)
    if not opts.store.exists():
        raise CliError(f"store {opts.store} {why_missing(opts.store)}")
    if not (opts.store / "manifest.json").exists():
        raise CliError(f"{opts.store} holds no gradient store (no manifest.json); write one with gradtrace collect")
    paths = [opts.store, *opts.member_stores]
    for path in opts.member_stores:
        if not (path / "manifest.json").exists():
            raise CliError(f"--store {path} holds no gradient store (no manifest.json); write one with gradtrace "
                           "collect")
    ens = opts.ensemble_options
    check_ensemble(opts.method, ens, len(paths), curvature=opts.curvature, index=None, tokens=False, world=1)
    stores = [GradientStore.open(path) for path in paths]
    fitted = load_fitted(opts.method, opts.curvature, list(ens.member_curvature), opts.store,
                         damping=opts.damping)  # gradtrace.cli.score_fit
    method = fitted if fitted else opts.method
    try:
        if len(stores) > 1:  # members matched by id; scores in STORE's order
            attributor = gradtrace.Ensemble(method, stores, weights=ens.ensemble_weights or None)
        else:
            attributor = gradtrace.Attributor(method[0] if fitted else method, stores[0])
        scores = attributor.self_scores(normalize=opts.normalize)
    except ValueError as err:  # EnsembleError, a store without num_targets for --normalize length, ...
        raise CliError(str(err)) from None
    store = stores[0]
    order = scores.argsort(descending=True).tolist()
    counts = store.field("num_targets")
    rows = [{"rank": r + 1, "id": store.ids[i], "self_influence": float(scores[i]), "num_targets": counts[i]}
            for r, i in enumerate(order)]
    texts = _texts(opts, store)
    for row in rows[:opts.top]:
        row["text"] = texts.get(row["id"])
    if opts.out is not None:
        _write(opts.out, rows)
    _print(opts, rows[:opts.top], len(rows))


def _texts(opts: SelfInfluenceCommand, store: Any) -> dict[str, str]:
    """Texts by id from --data or the data the store records (empty when neither can be read)."""
    from ..common.provenance import resolve_paths
    from ..data.prepare import dataset_texts
    from .load_data import data_warnings_shown
    from .load_model import load_tokenizer

    recorded = resolve_paths(store.manifest.get("config") or {}, store.root)  # paths relative to the store
    path = opts.data or (Path(recorded["data"]) if recorded.get("data") else None)
    if path is None or not path.exists():
        return {}
    tokenizer, source = None, recorded.get("tokenizer") or recorded.get("model")  # as collect tokenized it
    if source and Path(source).exists():
        base = recorded.get("base_model")  # of a PEFT adapter: the base it was collected on
        tokenizer = load_tokenizer(Path(source), Path(base) if base else None)
    with data_warnings_shown():  # the data changed since collect: one line on stderr
        return dataset_texts(path, tokenizer, recorded, text_field=recorded.get("text_field") or "text",
                             id_field=recorded.get("id_field") or "id", what="data")


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    from ..store.atomic import atomic_output

    fields = ["rank", "id", "self_influence", "num_targets"]
    plain = [{k: row[k] for k in fields} for row in rows]
    with atomic_output(path) as tmp, tmp.open("w", newline="") as handle:  # a failure leaves no half file
        if path.suffix.lower() == ".json":
            handle.write(json.dumps(plain, indent=1) + "\n")
            return
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(plain)


def _print(opts: SelfInfluenceCommand, rows: list[dict[str, Any]], total: int) -> None:
    out = console()
    kind = "mean loss per target token" if opts.normalize == "length" else "summed loss"
    members = len(opts.member_stores) + 1
    where = f"{opts.store}" if members == 1 else f"{opts.store} and {members - 1} more store(s), an ensemble"
    out.print(f"Highest self-influence ({opts.method}, {kind}) of {total:,} training examples in {where}:",
              markup=False, highlight=False)
    for row in rows:
        text = row.get("text")
        snippet = "" if text is None else " " + " ".join(text.split())[:opts.width]
        out.print(f"{row['rank']:>4}  {row['self_influence']:>12.4g}  {row['id']}{snippet}", markup=False,
                  highlight=False, soft_wrap=True)
    if opts.out is not None:
        out.print(f"All {total:,} written to {opts.out}", markup=False, highlight=False)
