"""``gradtrace score STORE QUERIES --out SCORES_DIR``: attribution scores of queries against a gradient store.

The queries' gradients are taken with the store's own projection (rebuilt from its manifest), so the two sides are
comparable by construction; a store and a model that do not match are refused.

Multi-checkpoint methods (TracIn) take one store per checkpoint, with its model and learning rate, by position::

    gradtrace score ckpt1/store queries.jsonl --method tracin --model ckpt1 --lr 3e-4 \\
        --store ckpt2/store --model ckpt2 --lr 1e-4 --out scores

Any other method takes further ``--store`` s as an ensemble (one member per checkpoint or model, with
``--member-curvature``, ``--ensemble-weights``: :mod:`gradtrace.cli.ensemble`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..common.model_dir import adapter_base
from ..common.paths import why_missing
from ..options.index import SearchOptions
from .commands import Group, api_field, cli, progress_flag, resolved
from .config import META_KEY, provenance, write_resolved
from .console import Phases, console
from .ensemble import EnsembleOptions, answering_model, check_ensemble, is_ensemble, score_ensemble
from .errors import CliError, os_error_line
from .groups import DataOptions, GenerateOptions, ModelOptions
from .load_model import (
    base_model_dir,
    recorded_model,
    resolve_device,
    tokenizer_dir,
)
from .method_choice import MethodName, method_help
from .outputs import check_output_dir, check_output_file
from .preference import DPOOptions
from .score_fit import fitted_methods
from .score_queries import query_gradients

__all__ = ["OPTIONS", "ScoreCommand", "run"]

EXPORT_SUFFIXES = (".csv", ".json", ".parquet")


@dataclass(kw_only=True)
class ScoringOptions(Group):
    """What is scored and what is kept."""

    panel = "Scoring"
    out: Path = field(metadata=cli("Directory to save the scores in (read it with gradtrace topk).", "--out", "-o",
                                   metavar="SCORES_DIR"))
    method: MethodName = field(default="grad_dot", metadata=cli(method_help()))
    topk: int = field(default=100, metadata=cli(
        "Keep the k highest and k lowest scores of every query (0: none; the full matrix is then needed).", min=0))
    matrix: Literal["auto", "yes", "no"] = field(default="auto", metadata=cli(
        "Keep the full queries x train matrix: yes, no, or auto (when it takes at most 1 GiB)."))
    block_rows: int | None = field(default=None, metadata=cli(
        "Training rows streamed per block (bounds memory; default: the rows of a 128 MiB float32 block, 8,192 at "
        "4,096 dims).", min=1))
    score_dtype: Literal["float32", "float64"] = field(default="float32", metadata=cli(
        "The dtype of the query x train products and of the saved scores (float64: exact to float64 round-off "
        "over the stored values; twice the memory of the blocks' products and of the matrix)."))
    export: Path | None = field(default=None, metadata=cli(
        "Also export the top-k rows of every query to this .csv, .json or .parquet file."))
    overwrite: bool = field(default=False, metadata=cli("Replace scores already saved in --out."))
    allow_partial: bool = field(default=False, metadata=cli(
        "Score the other queries when some have NaN/inf gradients (those are listed and left out); without it "
        "they are an error."))
    curvature: Path | None = field(default=None, metadata=cli(
        "What gradtrace fit saved for STORE: the curvature of kfac, ekfac, ggn, logra, or the fit of trak "
        "(its kernel) and trackstar (Adam's second moment, its preconditioner).", "--curvature", "--fit",
        metavar="FIT_DIR"))
    damping: float | None = field(default=None, metadata=cli(
        "Damping of the curvature (trak: of its kernel; trackstar: of its preconditioner; default: the one saved "
        "with the fit); no refit needed.", min=0))
    damping_mode: Literal["relative", "absolute"] | None = field(default=None, metadata=cli(
        "relative: damping times each block's mean eigenvalue; absolute: damping as is."))
    index: Path | None = field(default=None, metadata=cli(
        "Index of STORE (written by gradtrace index): shortlist --rerank rows per query from it, then score them "
        "exactly from the store. Serves grad_dot, kfac, ekfac, ggn, logra; grad_cos needs a --normalize index.",
        metavar="INDEX"))
    rerank: int | None = field(default=None, metadata=api_field(SearchOptions, "rerank"))
    norm_rows: int = field(default=0, metadata=api_field(SearchOptions, "norm_rows"))
    bottom: bool = field(default=True, metadata=api_field(SearchOptions, "bottom", "--bottom/--no-bottom"))
    nprobe: int | None = field(default=None, metadata=api_field(SearchOptions, "nprobe"))
    bottom_nprobe: int | None = field(default=None, metadata=api_field(SearchOptions, "bottom_nprobe"))
    modules: bool = field(default=False, metadata=cli(
        "Also split the score of every top-k and bottom-k pair by parameter block (saved with the scores; "
        "Scores.modules(query, train_id) and the HTML report show them)."))
    tokens: bool = field(default=False, metadata=cli(
        "Also split the score of every top-k and bottom-k pair by token, on the query side and the training side "
        "(the pairs' training examples are re-read from the store's data and re-captured with their tokens; "
        "Scores.tokens(query, train_id) and the HTML report show them)."))

    def search_options(self) -> SearchOptions:
        """The Python API's :class:`gradtrace.options.index.SearchOptions` of ``--index``'s options."""
        return SearchOptions(topk=self.topk, rerank=self.rerank, bottom=self.bottom, nprobe=self.nprobe,
                             bottom_nprobe=self.bottom_nprobe, norm_rows=self.norm_rows)


@dataclass(kw_only=True)
class CheckpointOptions(Group):
    """Several checkpoints (multi-checkpoint methods such as tracin)."""

    panel = "Checkpoints (tracin)"
    checkpoint_stores: list[Path] = field(default_factory=list, metadata=cli(
        "Another training store, one per further checkpoint (repeat; STORE is the first).", "--store",
        metavar="STORE"))
    lr: list[float] = field(default_factory=list, metadata=cli(
        "Learning rate of each checkpoint, in store order (repeat; tracin weights each checkpoint by it; not all 0).",
        min=0))


@dataclass(kw_only=True)
class ScoreCommand:
    """Options of ``gradtrace score``."""

    store: Path = field(metadata=cli("Gradient store of the training examples (written by gradtrace collect).",
                                     argument=True, metavar="STORE"))
    queries: Path = field(metadata=cli("Query examples, read like the training data: .jsonl, .json, .parquet, .csv, "
                                       ".txt or a save_to_disk directory; text, prompt-completion or messages.",
                                       argument=True, metavar="QUERIES"))
    model: list[Path] = field(default_factory=list, metadata=cli(
        "Model directory the query gradients are taken with; one per store, in order (default: the model each "
        "store records).", "--model", "-m", metavar="MODEL_DIR"))
    scoring_options: ScoringOptions
    checkpoint_options: CheckpointOptions
    ensemble_options: EnsembleOptions
    data_options: DataOptions
    dpo_options: DPOOptions
    generate_options: GenerateOptions
    model_options: ModelOptions
    progress: bool = progress_flag()
    dry_run: bool = field(default=False, metadata=cli(
        "Print the plan (rows, dims, queries, blocks, memory against what is available, output size, time from a "
        "timed first block) and stop: no model is loaded, nothing is written."))
    force: bool = field(default=False, metadata=cli("Score even when the planned memory exceeds what is available."))


OPTIONS = ScoreCommand


def run(opts: ScoreCommand) -> None:
    """Score query examples against a gradient store and save the scores.

    Query gradients are taken with the store's own projection (rebuilt from its manifest).
    Positive score = the training example helps the query (lowers its loss).

    Example: gradtrace score ./store queries.jsonl --model ./model --out ./scores --topk 20

    TracIn: one --store, --model and --lr per checkpoint, in order (STORE is the first checkpoint):
    gradtrace score ck1/store q.jsonl --method tracin --model ck1 --lr 3e-4 --store ck2/store --model ck2 --lr 1e-4

    Under torchrun (torchrun --nproc_per_node N -m gradtrace.cli score ...) every rank scores its share of the
    training rows, the top-k is merged with collectives, and rank 0 writes the outputs.
    """
    from ..distributed import RankFailure, process_group

    device = resolve_device(opts.model_options.device)
    with process_group(device) as (rank, world):
        try:
            _run(opts, device, rank, world)
        except RankFailure as err:  # another rank's bad input: report it here too
            raise CliError(str(err)) from None


def _run(opts: ScoreCommand, device: str, rank: int, world: int) -> None:
    import gradtrace

    from ..distributed import agreed
    from ..fit.methods import method_class
    from ..projection import LoGra, projection_from_dict
    from ..score.diagnostics import diagnose
    from ..score.sharded import score_sharded
    from ..store import GradientStore
    from ..store.atomic import naming

    phases = Phases()
    sc, ck, data_opts, model_opts = (opts.scoring_options, opts.checkpoint_options, opts.data_options,
                                     opts.model_options)
    multi = method_class(sc.method).multi_checkpoint
    store_paths = [opts.store, *ck.checkpoint_stores]
    options: dict[str, Any] = {"weights": list(ck.lr)} if multi else {}
    with agreed("preparing the scoring"):  # no collective inside: an error on one rank is raised on all
        _check_out(sc)
        _check_checkpoints(sc.method, multi, store_paths, ck)
        ensemble = is_ensemble(sc.method, len(store_paths))
        check_ensemble(sc.method, opts.ensemble_options, len(store_paths), curvature=sc.curvature, index=sc.index,
                       tokens=sc.tokens or sc.modules, world=world)
        for flag, wanted in (("--modules", sc.modules), ("--tokens", sc.tokens)):
            if wanted and not sc.topk:
                raise CliError(f"{flag} splits the top-k pairs of each query: pass --topk K (K > 0)")
        if sc.tokens and multi:
            raise CliError(f"--tokens splits one checkpoint's scores; {sc.method} combines checkpoints")
        if sc.score_dtype != "float32" and (ensemble or sc.index is not None):
            raise CliError(f"--score-dtype {sc.score_dtype} applies to scoring the store directly, not to "
                           f"{'an ensemble' if ensemble else '--index'}")
        with phases("open stores"):
            for path in store_paths:
                if not path.exists():
                    raise CliError(f"store {path} {why_missing(path)}")
            stores = [GradientStore.open(path) for path in store_paths]
        if sc.tokens:  # the data --tokens re-captures from is there and unchanged, before any model work
            from .pair_tokens import recorded_data

            recorded_data(stores[0])
        fitted = fitted_methods(sc, store_paths[0], opts.ensemble_options)  # gradtrace.cli.score_fit
        index = _open_index(sc, stores[0], multi or ensemble, world)
        models = _models(opts.model, stores)
        gen = opts.generate_options  # --generate: the model explained answers (gradtrace.cli.ensemble)
        answering, answer_why = answering_model(models, gen.generate, gen.answer_model)
        text_with = tokenizer_dir(model_opts.tokenizer, stores[0], models[0])  # --tokenizer, recorded, or the model's
        if not _preflight(opts, stores, device, phases, rank):  # gradtrace.cli.preflight
            return
        query_sets, max_length, dropped, answers, query_data = query_gradients(opts, stores, models, text_with,
                                                                       device, phases, opts.progress and rank == 0,
                                                                       answering)
    with phases("score"):
        matrix = {"auto": "auto", "yes": True, "no": False}[sc.matrix]
        if ensemble:  # several stores of a single-checkpoint method: one member each (gradtrace.cli.ensemble)
            attributor, scores = score_ensemble(fitted or sc.method, stores, query_sets, opts.ensemble_options,
                                                topk=sc.topk or None, matrix=matrix, block_rows=sc.block_rows,
                                                device=device, progress=opts.progress)
        else:
            attributor = gradtrace.Attributor(fitted[0] if fitted else sc.method,
                                              train=stores if multi else stores[0],
                                              block_rows=sc.block_rows, device=device, score_dtype=sc.score_dtype,
                                              **options)
            try:  # one process: attributor.score(); under torchrun: every rank scores its rows, top-k merged
                scorer = score_sharded if index is None else _index_scorer(index, sc)  # --index: shortlist
                scores = scorer(attributor, query_sets if multi else query_sets[0], topk=sc.topk or None,
                                matrix=matrix, progress=opts.progress)
            except ValueError as err:  # curvature from other gradients, singular curvature, ...
                raise CliError(str(err)) from None
    phases.note("score", f"{attributor.profile.get('rows_per_s', 0):,.0f} training rows/s")
    if sc.modules:
        with phases("modules"):  # every rank: the same pairs, no collective
            attributor.module_scores(query_sets if multi else query_sets[0], scores, k=sc.topk)
    if sc.tokens:
        from .pair_tokens import token_attributions

        with phases("tokens"):  # every rank: the same pairs re-captured, no collective
            token_attributions(attributor, query_sets[0], query_data, scores, store=stores[0], model_dir=models[0],
                               tokenizer_dir=text_with,
                               base_model=base_model_dir(model_opts.base_model, stores[0], models[0]),
                               projection=projection_from_dict(stores[0].spec.projection, expect=LoGra,
                                                               what=f"the gradients of store {stores[0].root}"),
                               device=device, model_dtype=model_opts.model_dtype, k=sc.topk,
                               progress=opts.progress and rank == 0)
    final = replace(opts, model=list(models), data_options=replace(data_opts, max_length=max_length),
                    generate_options=replace(gen, answer_model=models[answering] if gen.generate else None),
                    model_options=replace(model_opts, device=device,  # recorded when not the model's own
                                          tokenizer=None if text_with == models[0] else text_with,
                                          base_model=adapter_base(models[0], base_model_dir(
                                              model_opts.base_model, stores[0], models[0]))))
    values = resolved(final)
    scores.meta["config"] = {META_KEY: provenance("score", opts.queries, len(scores.query_ids)), **values}
    if dropped:
        scores.meta["dropped_queries"] = {"ids": dropped, "reason": "NaN/inf gradients"}
    if answers is not None:
        scores.meta["answers"] = answers  # --generate: the model's answer to each query prompt, by query id
    with phases("diagnose"):  # is the ranking to be trusted? (saved with the scores; topk and the report show it)
        diagnosis = diagnose(scores, train=list(stores), queries=list(query_sets),
                             label="the model" if len(stores) == 1 else "every member")
        scores.meta["diagnostics"] = diagnosis.to_dict()
    written = None
    with agreed("saving the scores"), phases("save"):
        if rank == 0:  # every rank holds the same scores; one writes them
            try:
                scores.save(sc.out, overwrite=sc.overwrite)
                written = write_resolved(sc.out, "score", values)
                if sc.export:
                    scores.export(sc.export, k=sc.topk or None)
            except OSError as err:  # a full disk, a read-only directory: scores saved before stay intact
                raise CliError(f"could not save the scores in {sc.out}: {os_error_line(naming(err, sc.out))}; "
                               "scores saved there before are kept", exit_code=1) from None
    if rank != 0:
        return
    out = console()
    kept = "full matrix" if scores.matrix is not None else "no matrix"
    sides = "top/bottom" if scores.bottom is not None else "top"
    kept += f", {sides} {scores.top[0].shape[1]}" if scores.top is not None else ""
    out.print(f"Scored {len(scores.query_ids):,} queries against {len(scores.train_ids):,} training examples with "
              f"{sc.method}; saved in {sc.out}")
    if dropped:
        out.print(f"[yellow]Warning: {len(dropped)} quer{'y' if len(dropped) == 1 else 'ies'} with NaN/inf gradients "
                  f"left out (--allow-partial): {', '.join(dropped[:5])}{' ...' if len(dropped) > 5 else ''}[/yellow]")
    out.print(f"  kept        {kept}")
    out.print(f"  models      {', '.join(str(m) for m in models)}")
    if world > 1:
        shares = ", ".join(f"{n:,}" for n in scores.meta["distributed"]["rows"])
        out.print(f"  ranks       {world} (training rows per rank: {shares}); outputs written by rank 0")
    out.print("  sign        positive = the training example helps the query (lowers its loss)")
    for line in diagnosis.lines():
        out.print(f"  diagnostics {line}")
    for warning in diagnosis.warnings:
        out.print(f"[yellow]Warning: {warning}[/yellow]")
    if scores.meta.get("ensemble"):  # not the method's values (a grad_cos ensemble's are not cosines)
        out.print(f"  scores      {scores.units}")
    if sc.export:
        out.print(f"  export      {sc.export} (top {sc.topk or 'all'} rows per query)")
    out.print(f"  config      {written}")
    if answers is not None:
        why = f"{answer_why}; " if answer_why else ""  # several stores: which one answered, and why
        out.print(f"  answers     {len(answers):,} generated by {models[answering]} ({why}saved with the scores; shown "
                  "by topk)")
    out.print(f"Next: gradtrace topk {sc.out}")  # texts: from the data the store records (or --data)
    if opts.progress:
        console(stderr=True).print(phases.table())


def _preflight(opts: ScoreCommand, stores: list[Any], device: str, phases: Phases, rank: int) -> bool:
    """Print the plan (rank 0) and refuse what cannot fit; False for --dry-run (stop there)."""
    import gradtrace

    from .preflight import check_score_plan, count_records, print_plan, score_plan_lines

    sc = opts.scoring_options
    with phases("plan"):
        queries = count_records(opts.queries, opts.data_options, "queries")
        if queries == 0:
            raise CliError(f"queries {opts.queries} hold no example")
        planned = gradtrace.plan_score(stores, queries, topk=sc.topk or None,
                                       matrix={"auto": "auto", "yes": True, "no": False}[sc.matrix],
                                       block_rows=sc.block_rows, device=device)
    if rank == 0:
        print_plan(score_plan_lines(planned))
    if opts.dry_run:
        return False
    check_score_plan(planned, opts.force)
    return True


def _check_out(sc: ScoringOptions) -> None:
    check_output_dir(sc.out, "--out", stem="scores", what="scores", overwrite=sc.overwrite)
    if sc.export is not None:
        check_output_file(sc.export, "--export", overwrite=sc.overwrite, own=sc.out)
    if sc.export is not None and sc.export.suffix.lower() not in EXPORT_SUFFIXES:
        raise CliError(f"--export {sc.export}: unknown format {sc.export.suffix or '(no suffix)'!r}; use a .csv, "
                       ".json or .parquet file")
    if sc.export is not None and sc.export.suffix.lower() == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise CliError("--export to .parquet needs pyarrow (pip install pyarrow)") from None


def _check_checkpoints(method: str, multi: bool, store_paths: list[Path], ck: CheckpointOptions) -> None:
    if not multi:  # further --store make an ensemble (gradtrace.cli.ensemble)
        if ck.lr:
            raise CliError(f"--lr weights checkpoints, which {method} does not use (tracin does)")
        return
    if len(ck.lr) != len(store_paths):
        raise CliError(f"--method {method} needs one --lr per checkpoint: got {len(ck.lr)} for {len(store_paths)} "
                       f"stores (STORE and {len(ck.checkpoint_stores)} --store)")
    if not any(ck.lr):  # each is a finite number >= 0 (gradtrace.cli.commands.check_values)
        raise CliError("--lr: every learning rate is 0, which makes every score 0; give the checkpoints their "
                       "learning rates")


def _models(given: list[Path], stores: list[Any]) -> list[Path]:
    """One model directory per store: as given (in order), else the one each store records."""
    if given:
        if len(given) != len(stores):
            raise CliError(f"{len(given)} --model for {len(stores)} stores: give one --model per store, in order")
        return list(given)
    return [recorded_model(store) for store in stores]


# -- --index: shortlist from an approximate index, exact re-scoring (gradtrace.score.shortlist) -----------------
def _open_index(sc: ScoringOptions, store: Any, multi: bool, world: int) -> Any:
    """The ``--index`` of the store, checked against it and the options (None without ``--index``)."""
    if sc.index is None:
        for flag, given in (("--rerank", sc.rerank is not None), ("--norm-rows", sc.norm_rows > 0),
                            ("--no-bottom", not sc.bottom), ("--nprobe", sc.nprobe is not None),
                            ("--bottom-nprobe", sc.bottom_nprobe is not None)):
            if given:
                raise CliError(f"{flag} applies to the shortlist of --index; pass --index INDEX (written by "
                               "gradtrace index)")
        return None
    from ..fit.methods import get_method
    from ..score.index import FaissMissing, Index
    from ..score.shortlist import check_norm_rows, index_normalization

    if world > 1:
        raise CliError("--index scores in one process; run it without torchrun")
    if not sc.topk:
        raise CliError("--index keeps a top-k only: pass --topk K (K > 0)")
    if sc.matrix == "yes":
        raise CliError("--index keeps a top-k only, not the full matrix: drop --matrix yes or --index")
    if sc.rerank is not None and sc.rerank < sc.topk:
        raise CliError(f"--rerank {sc.rerank} is smaller than --topk {sc.topk}: the shortlist must hold the top-k")
    if multi:
        raise CliError(f"--index serves one store; {sc.method} combines checkpoints: score it without --index")
    try:
        index = Index.load(sc.index)
    except FaissMissing as err:
        raise CliError(str(err)) from None
    if (sc.nprobe or sc.bottom_nprobe) and index.params.kind != "ivfpq":
        raise CliError(f"--nprobe / --bottom-nprobe choose IVF cells; {sc.index} is a {index.params.kind} index")
    try:
        normalized = index_normalization(get_method(sc.method))
    except ValueError as err:  # a method with its own per-row transform (trackstar)
        raise CliError(f"--index: {err}") from None
    if normalized != index.normalized:
        raise CliError(f"--index {sc.index} holds {'normalized' if index.normalized else 'raw'} rows; --method "
                       f"{sc.method} needs an index {'built with' if not index.normalized else 'without'} --normalize")
    index.check_store(store)
    check_norm_rows(index, sc.norm_rows)
    return index


def _index_scorer(index: Any, sc: ScoringOptions) -> Any:
    """``score_sharded``'s signature, scoring through ``index`` with ``--rerank``."""
    from ..score.shortlist import score_with_index

    options = sc.search_options()  # --topk is K > 0 with --index (_open_index)

    return lambda attributor, queries, *, topk, matrix, progress: score_with_index(attributor, queries, index,
                                                                                   options)
