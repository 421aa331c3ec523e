"""``gradtrace score``'s queries: read once (texts, prompts answered with ``--generate``, or preference pairs), their
gradients taken at every checkpoint with each store's projection, and checked against the stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..options import CaptureOptions, RunOptions
from .console import Phases, console
from .errors import CliError
from .load_model import base_model_dir, load_model, load_tokenizer, pad_id, resolve_max_length
from .preference import pair_loss, read_examples

__all__ = ["check_dropped", "check_match", "query_gradients", "recorded_grad_dtype"]


def query_gradients(opts: Any, stores: list[Any], models: list[Path], text_with: Path, device: str,
                     phases: Phases, progress: bool, answering: int = 0
                     ) -> tuple[list[Any], int | None, list[str], dict[str, str] | None, Any]:
    """The queries' gradients at every checkpoint, each with its store's projection (in store order); the
    resolved ``--max-length``; the ids of the queries left out for NaN/inf gradients (an error unless
    ``--allow-partial``); with --generate, the answer of model ``answering`` (loaded first) to each query by id;
    the tokenized queries. The queries are tokenized (and answered) once, with the tokenizer in ``text_with``;
    with --tokens their gradients keep their token-level factors."""
    import gradtrace

    from ..capture.collect import NonFiniteError
    from ..projection import LoGra, projection_from_dict
    from .collect import store_layers

    data_opts = opts.data_options
    projections = [projection_from_dict(s.spec.projection, expect=LoGra, what=f"the gradients of store {s.root}")
                   for s in stores]
    base_model = opts.model_options.base_model
    with phases("read queries"):
        tokenizer = load_tokenizer(text_with, base_model_dir(base_model, stores[0], models[0]))
    query_sets: list[Any] = [None] * len(stores)
    max_length, batches = None, None
    for c in [answering, *(c for c in range(len(stores)) if c != answering)]:  # the answering model first
        store, model_dir, projection = stores[c], models[c], projections[c]
        with phases("load model"):
            model = load_model(model_dir, device, opts.model_options.model_dtype,
                               base_model_dir(base_model, store, model_dir))
        if batches is None:
            with phases("read queries"):
                max_length = resolve_max_length(data_opts.max_length, model)
                batches = read_examples(opts.queries, tokenizer, data_opts, opts.dpo_options, max_length,
                                        pad_id(tokenizer), device, opts.model_options.model_dtype, what="queries",
                                        generate=opts.generate_options.settings(model),
                                        tokens=opts.scoring_options.tokens)
            console().print(batches.summary.line(), markup=False, highlight=False, soft_wrap=True)
        with phases("query gradients"):
            try:
                capture = CaptureOptions(projection=projection, layers=store_layers(store),
                                         keep_tokens=opts.scoring_options.tokens,
                                         grad_dtype=recorded_grad_dtype(store, projection))
                run = RunOptions(device=device, progress="collect queries" if progress else False)
                queries = gradtrace.collect(model, batches, pair_loss(batches, opts.dpo_options), options=capture,
                                            run=run)
            except NonFiniteError as err:
                raise CliError(f"queries {opts.queries} with model {model_dir}: {err}") from None
        check_match(store, queries, model_dir)
        check_dropped(queries, batches.num_examples, model_dir, opts, query_sets[answering], models[answering])
        query_sets[c] = queries
        del model
    answers = dict(zip(batches.ids, batches.answers)) if batches.answers is not None else None
    return query_sets, max_length, list(getattr(query_sets[0], "dropped", [])), answers, batches


def check_dropped(queries: Any, total: int, model_dir: Path, opts: Any, first: Any, first_model: Path
                   ) -> None:
    """Queries whose gradients are NaN/inf are left out by collect(): an error naming them, unless
    ``--allow-partial`` (then every checkpoint must leave out the same ones as ``first``, the query gradients
    taken first, with ``first_model``; None for those)."""
    dropped = list(getattr(queries, "dropped", []))
    if dropped and not opts.scoring_options.allow_partial:
        listing = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
        raise CliError(f"{len(dropped)} of {total} queries of {opts.queries} have NaN/inf gradients with model "
                       f"{model_dir} and cannot be scored: {listing}. Fix them, or pass --allow-partial to score the "
                       f"other {total - len(dropped)}")
    if first is not None and list(queries.ids) != list(first.ids):
        raise CliError(f"with model {model_dir} other queries have NaN/inf gradients ({', '.join(dropped[:5])}) than "
                       f"with {first_model}; the checkpoints cannot be scored on the same queries")


def check_match(store: Any, queries: Any, model_dir: Path) -> None:
    """Refuse query gradients that cannot be compared with the store; warn about weights other than the store's
    (those of a checkpoint a Trainer run saved inside the captured step range, or of its final model, are its)."""
    from ..integrations.trainer_store import trained_weights
    from ..store.spec import SpecMismatch

    try:
        store.spec.check_compatible(queries.spec, f"store {store.root} vs the queries' gradients from {model_dir}")
    except SpecMismatch as err:
        raise CliError(str(err)) from None
    weights = queries.spec.model.get("weights")
    if weights != store.spec.model.get("weights") and weights not in trained_weights(store):
        console(stderr=True).print(
            f"[yellow]Warning: the weights of {model_dir} differ from those of the model that collected "
            f"{store.root}; the scores compare gradients taken at different weights.[/yellow]")


def recorded_grad_dtype(store: Any, projection: Any) -> str:
    """The ``CaptureOptions.grad_dtype`` the store was collected with (``"float32"`` for stores collected before it
    was recorded, and without a projection): queries are projected the same way."""
    if projection is None:
        return "float32"
    options = ((store.manifest.get("config") or {}).get("gradtrace") or {}).get("options") or {}
    return (options.get("capture") or {}).get("grad_dtype", "float32")
