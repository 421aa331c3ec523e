"""``gradtrace score --tokens``: per-token attribution of the top-k pairs, with the training examples re-captured.

A store keeps one vector per training example, so the training side re-reads the store's own data (the file
and data options it records), selects the pairs' training examples by id, and collects only those rows with
token-level factors, with the store's projection and the scoring model. The query side uses the queries'
gradients, collected with their tokens. Both are checked to sum to the kept scores
(:func:`gradtrace.score.pairs.token_attributions`). The re-captured rows are float32 whatever the store's dtype:
from a bfloat16 or int8 store they are checked to round to the stored rows, and the training side sums to the
pairs' float32 scores (those a float32 store keeps), recorded with them.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from ..common.provenance import resolve_paths
from ..data.files import data_changed
from ..options import CaptureOptions, RunOptions
from .errors import CliError
from .groups import DataOptions
from .load_data import read_dataset
from .load_model import load_model, load_tokenizer, pad_id

__all__ = ["recorded_data", "token_attributions"]


def recorded_data(store: Any) -> tuple[Path, DataOptions]:
    """The training data file and data options a store records (written by ``gradtrace collect``); refused when
    the file is gone or no longer holds the bytes the store fingerprinted."""
    recorded = resolve_paths(store.manifest.get("config") or {}, store.root)
    data = recorded.get("data")
    if not data:
        raise CliError(f"--tokens re-captures the top-k training examples from the store's data, but store "
                       f"{store.root} does not record its data file; collect it with gradtrace collect")
    if not Path(data).exists():
        raise CliError(f"--tokens re-captures the top-k training examples from {data}, the data store "
                       f"{store.root} was collected from, which no longer exists; put it back there")
    changed = data_changed(data, recorded)  # the size, then (same size) the content hash the store records
    if changed is not None:
        raise CliError(f"--tokens re-captures the top-k training examples from {data}, the data store {store.root} "
                       f"was collected from, but it changed since ({changed}): its examples may not be the stored "
                       "ones; put the collected file back, or collect the store again")
    known = {f.name for f in fields(DataOptions)}
    return Path(data), DataOptions(**{name: value for name, value in recorded.items() if name in known})


def _token_strings(dataset: Any, ids: list[str], tokenizer: Any) -> dict[str, list[str]]:
    """``{id: [token text, ...]}`` of examples of a tokenized dataset (each token decoded on its own)."""
    where = {ident: i for i, ident in enumerate(dataset.ids)}
    return {ident: tokenizer.batch_decode(dataset.example(where[ident])[0].reshape(-1, 1).tolist())
            for ident in ids}


def _loss_masks(dataset: Any, ids: list[str]) -> dict[str, list[bool]]:
    """``{id: [in the loss, ...]}`` of examples of a tokenized dataset, one flag per token."""
    where = {ident: i for i, ident in enumerate(dataset.ids)}
    return {ident: dataset.example(where[ident])[1].astype(bool).tolist() for ident in ids if ident in where}


def token_attributions(attributor: Any, queries: Any, query_data: Any, scores: Any, *, store: Any, model_dir: Path,
                       projection: Any, device: str, model_dtype: str, k: int, progress: bool,
                       tokenizer_dir: Path | None = None, base_model: Path | None = None) -> None:
    """Record ``scores.meta["tokens"]`` for the top and bottom ``k`` pairs of every query (both sides);
    ``tokenizer_dir``: where the tokenizer is (default the model's); ``base_model``: that of a PEFT adapter
    ``model_dir`` (default: the one it names)."""
    import gradtrace

    from ..score.pairs import pair_rows
    from .collect import store_layers

    data_path, data_opts = recorded_data(store)
    tokenizer = load_tokenizer(tokenizer_dir or model_dir, base_model)
    train_data = read_dataset(data_path, tokenizer, data_opts, data_opts.max_length, pad_id(tokenizer),
                              what="training data")
    pairs = pair_rows(scores, k)
    wanted = [scores.train_ids[t] for t in np.unique(pairs.train.numpy()).tolist()]
    where = {ident: i for i, ident in enumerate(train_data.ids)}
    missing = [ident for ident in wanted if ident not in where]
    if missing:
        raise CliError(f"training examples {missing[:3]} of the scores are not in {data_path} (read with the "
                       f"store's data options): the data changed since store {store.root} was collected")
    rows = np.asarray([where[ident] for ident in wanted], dtype=np.int64)
    size = data_opts.batch_size
    batches = [train_data.rows(rows[start:start + size]) for start in range(0, len(rows), size)]
    model = load_model(model_dir, device, model_dtype, base_model)
    # in memory: float32 whatever the store's dtype
    recaptured = gradtrace.collect(model, batches,
                                   options=CaptureOptions(projection=projection, layers=store_layers(store),
                                                          keep_tokens=True),
                                   run=RunOptions(device=device, progress=progress))
    tokens = {**_token_strings(query_data, list(scores.query_ids), tokenizer),
              **_token_strings(train_data, wanted, tokenizer)}
    try:
        attributor.token_attributions(queries, scores, train_tokens=recaptured, tokens=tokens, k=k)
    except ValueError as err:
        raise CliError(f"--tokens: {err}") from None
    in_loss = {**_loss_masks(query_data, list(scores.query_ids)), **_loss_masks(train_data, wanted)}
    for record in scores.meta.get("tokens") or []:  # which tokens were in the loss: the report marks them
        for side, ident in (("query", record["query_id"]), ("train", record["train_id"])):
            mask = in_loss.get(ident)
            if mask is not None and len(mask) == len(record.get(f"{side}_tokens") or []):
                record[f"{side}_in_loss"] = mask
