"""Where the report's texts come from: the datasets a score run recorded, read with one re-pointable reader.

``gradtrace score`` records the training store (whose manifest records the training data it was collected
from, with its text/id fields, tokenizer model and max length) and the query file. :func:`recorded_sources`
finds both; :func:`read_texts` is the single place the report reads a dataset, through
:func:`gradtrace.data.texts` with the data options recorded when it was collected or scored (as ``gradtrace topk``
reads it), so its ids are the stored ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.errors import UsageError
from ..common.model_dir import load_tokenizer
from ..common.provenance import resolve_paths
from ..data.errors import DataError
from ..data.prepare import dataset_texts
from .errors import ReportError

__all__ = ["DataSource", "read_texts", "recorded_sources", "resolve_source"]


@dataclass(frozen=True)
class DataSource:
    """A dataset file and how to read it: the text/id fields, the tokenizer and max length that content-hash
    ids need (None: the file has its own ids), and the other data options recorded with it (format, split,
    prompt/completion/messages fields, --generate; see :func:`gradtrace.data.prepare.dataset_texts`)."""

    path: Path
    text_field: str = "text"
    id_field: str = "id"
    model: Path | None = None
    max_length: int | None = None
    recorded: Mapping[str, Any] = field(default_factory=dict)
    model_given: bool = False
    """``model`` was given by the user (a tokenizer that fails to load is then an error; a recorded one that is
    gone is skipped, which works for data with its own ids)."""


def read_texts(source: DataSource, *, what: str = "data") -> dict[str, str]:
    """``{id: text}`` of ``source``, ids computed as the collect/score commands computed them."""
    try:
        tokenizer = _tokenizer(source)
        recorded = {**source.recorded, "max_length": source.max_length}
        return dataset_texts(source.path, tokenizer, recorded, text_field=source.text_field,
                             id_field=source.id_field, what=what)
    except (UsageError, DataError) as err:
        raise ReportError(str(err)) from None


def _tokenizer(source: DataSource) -> Any:
    """The tokenizer of ``source.model`` (None without one, or when a recorded model directory is gone: data with
    its own ids needs none, and data without them says to pass ``--model``)."""
    if source.model is None:
        return None
    base = source.recorded.get("base_model")  # of a PEFT adapter: the base it was collected on
    try:
        return load_tokenizer(source.model, Path(base) if base else None)
    except UsageError:
        if source.model_given:
            raise
        return None


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _source(config: dict[str, Any], key: str) -> DataSource | None:
    path = config.get(key)
    if not path:
        return None
    model = config.get("tokenizer") or _first(config.get("model"))  # the directory the command tokenized with
    return DataSource(Path(path), config.get("text_field") or "text", config.get("id_field") or "id",
                      Path(model) if model else None, config.get("max_length"), config)


def recorded_sources(meta: dict[str, Any]) -> tuple[DataSource | None, DataSource | None]:
    """``(training data, queries)`` recorded by ``gradtrace score`` in ``Scores.meta["config"]`` (None where a
    source was not recorded: scores made in Python, or a store collected in Python). The store's paths are read
    against its folder (:func:`gradtrace.common.provenance.resolve_paths`)."""
    config = meta.get("config") or {}
    queries = _source(config, "queries")
    store = config.get("store")
    if not store:  # gradtrace metagrad: the decoded training examples, saved beside the scores
        texts = config.get("train_texts")
        return (DataSource(Path(texts)) if texts else None), queries
    try:
        manifest = json.loads((Path(store) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None, queries
    return _source(resolve_paths(manifest.get("config") or {}, store), "data"), queries


def resolve_source(given: str | Path | None, recorded: DataSource | None, *, what: str, option: str,
                   text_field: str | None = None, id_field: str | None = None, model: str | Path | None = None,
                   fields: Mapping[str, str] | None = None) -> DataSource:
    """The dataset to read: ``given`` (read with the recorded settings, overridden by ``text_field``,
    ``id_field``, ``model`` and the data options ``fields``: ``{"prompt_field": ..., ...}``), else the ``recorded``
    one; an error naming ``option`` when there is neither or the recorded file is gone."""
    if given is None:
        if recorded is None:
            raise ReportError(f"the scores record no {what} to take texts from (scored in Python, or from a store "
                              f"collected in Python): pass {option}")
        if not recorded.path.exists():
            raise ReportError(f"the {what} recorded with the scores, {recorded.path}, does not exist: pass {option}")
    base = recorded or DataSource(Path(given))  # type: ignore[arg-type]
    chosen = model or base.model
    return DataSource(Path(given) if given is not None else base.path, text_field or base.text_field,
                      id_field or base.id_field, Path(chosen) if chosen else None, base.max_length,
                      {**base.recorded, **(fields or {})}, model_given=model is not None)
