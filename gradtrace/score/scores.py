"""``Scores``: attribution scores of queries against training examples, with top-k, save/load and exports.

Sign and units: a **positive score means the training example helps the query** (a gradient step on it
lowers the query's loss). Units depend on the method: ``grad_dot``/``tracin`` scores are products of
gradients (loss^2 per parameter^2, times a learning rate for TracIn), ``grad_cos`` scores are cosines.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.provenance import record_paths, resolve_paths
from ..fit.methods.base import SIGN_CONVENTION
from ..options import RECORD_KEY
from ..options.report import ReportOptions
from ..store.artifact import (
    ArtifactError,
    atomic_output,
    atomic_write_bytes,
    read_artifact,
    refuse_inside_artifact,
    write_artifact,
)

__all__ = ["Scores", "ScoresError", "TopK", "scoring_meta"]

FORMAT = "gradtrace-scores"
VERSION = 2
"""2: manifest and tensors checksummed (version 1, without checksums, still loads with a warning)."""
_TENSORS = ("matrix", "top_values", "top_indices", "bottom_values", "bottom_indices")


def scoring_meta(method: Any, spec: Any, *, weights: Sequence[float], topk: int | None, matrix: bool,
                 block_rows: int, device: Any, profile: dict[str, Any], score_dtype: str = "float32") -> dict[str, Any]:
    """The ``meta`` of freshly computed :class:`Scores`: what produced them.

    ``method`` (a :class:`gradtrace.fit.methods.Method`) and the ``spec`` of the training gradients, as before
    (``meta["method"]``, ``meta["options"]``, ``meta["spec"]``, ``meta["checkpoints"]``, ``meta["profile"]``),
    and the resolved scoring settings in ``meta["gradtrace"]["options"]["score"]``, where stores and curvatures
    record theirs: the method and its options, the checkpoints' ``weights``, ``topk``, whether the full
    ``matrix`` was kept, ``block_rows``, the ``device`` and the ``score_dtype`` of the query x train products.
    """
    options = method.options()
    resolved = {"method": method.name, "method_options": options, "checkpoint_weights": [float(w) for w in weights],
                "topk": topk, "matrix": bool(matrix), "block_rows": int(block_rows), "device": str(device),
                "score_dtype": str(score_dtype)}
    return {"method": method.name, "options": options,
            "spec": {"projection": spec.projection, "convention": spec.convention, "dim": spec.dim,
                     "model": spec.model},
            "checkpoints": len(weights), "profile": dict(profile), RECORD_KEY: {"options": {"score": resolved}}}



class ScoresError(ArtifactError):
    """Scores that cannot be trusted: non-finite values, inconsistent shapes or indices, a corrupted save."""


@dataclass
class TopK:
    """The ``k`` highest (or lowest) scores of each query: ``values``/``indices`` are ``[Q, k]``;
    ``ids[q]`` lists the training ids in rank order."""

    values: Tensor
    indices: Tensor
    ids: list[list[str]]


@dataclass
class Scores:
    """Scores of ``Q`` queries against ``N`` training examples.

    matrix: ``[Q, N]`` float32 (float64 when scored with ``score_dtype="float64"``), or None when only the
        streaming top-k was kept (large stores).
    top, bottom: the streaming top-k highest / lowest scores (kept when the matrix is not, and
        whenever the engine was asked for them).
    train_ids, query_ids: row and column ids. method: the method name; meta: settings and provenance.
    """

    train_ids: list[str]
    query_ids: list[str]
    method: str
    matrix: Tensor | None = None
    top: tuple[Tensor, Tensor] | None = None
    bottom: tuple[Tensor, Tensor] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meta.setdefault("sign", SIGN_CONVENTION)
        num_q, num_train = len(self.query_ids), len(self.train_ids)
        if self.matrix is not None:
            if tuple(self.matrix.shape) != (num_q, num_train):
                raise ScoresError(f"matrix of shape {tuple(self.matrix.shape)} for {num_q} queries and {num_train} "
                                  "training examples")
            self._check_finite(self.matrix, "scores")
        for name, kept in (("top", self.top), ("bottom", self.bottom)):
            if kept is None:
                continue
            values, indices = kept
            if values.dim() != 2 or values.shape != indices.shape or values.shape[0] != num_q:
                raise ScoresError(f"{name} values {tuple(values.shape)} and indices {tuple(indices.shape)}: both must "
                                  f"be [{num_q} queries, k]")
            if indices.dtype != torch.int64 or (indices.numel() and (int(indices.min()) < 0
                                                                     or int(indices.max()) >= num_train)):
                raise ScoresError(f"{name} indices must be int64 rows of the {num_train} training examples")
            self._check_finite(values, f"{name} scores")

    def _check_finite(self, values: Tensor, what: str) -> None:
        """Refuse NaN/inf (they would rank first in a top-k, or poison any mean), naming the queries."""
        bad = ~torch.isfinite(values).all(dim=1)
        if bool(bad.any()):
            names = [self.query_ids[i] for i in bad.nonzero().flatten()[:5].tolist()]
            raise ScoresError(f"{what} of {int(bad.sum())} queries hold NaN/inf (query ids {names}"
                              f"{', ...' if int(bad.sum()) > 5 else ''})")

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.query_ids), len(self.train_ids))

    @property
    def combination(self) -> str | None:
        """How these scores combine several stores, in words (None: one model's scores).

        ``"ensemble of 3 members (equal weights; each member's scores divided by their mean |score|)"`` for a
        :class:`~gradtrace.Ensemble`, ``"unrolled over 6 checkpoints"`` for :class:`~gradtrace.Unrolled`,
        ``"4 checkpoints"`` for a method that sums over checkpoints itself (``tracin``)."""
        meta = self.meta or {}
        ensemble, unrolled = meta.get("ensemble"), meta.get("unrolled")
        if ensemble:
            weights = [float(w) for w in ensemble.get("weights") or []]
            equal = all(abs(w - weights[0]) <= 1e-9 for w in weights)
            weighting = "equal weights" if equal else "weights " + ", ".join(f"{w:.3g}" for w in weights)
            scaling = ("each member's scores divided by their mean |score|" if ensemble.get("normalize")
                       else "member scores summed as they are")
            return f"ensemble of {ensemble.get('members', len(weights))} members ({weighting}; {scaling})"
        if unrolled:
            return f"unrolled over {unrolled.get('checkpoints')} checkpoints"
        if meta.get("checkpoints", 1) > 1:
            return f"{meta['checkpoints']} checkpoints"
        return None

    @property
    def units(self) -> str:
        """What the values are, in words: the label every display of these scores uses (``gradtrace score``,
        ``topk``, ``inspect``, the HTML report). One model's scores: the method's description (``grad_cos``:
        cosines in [-1, 1]). An :class:`~gradtrace.Ensemble`'s: *normalised ensemble scores* -- each member's
        scores divided by their mean |score|, then weighted -- which are not the method's values (a ``grad_cos``
        ensemble's are not cosines and leave [-1, 1])."""
        from ..fit.methods import get_method

        try:
            description = get_method(self.method).description
        except Exception:  # an unknown or option-requiring method: no description to show
            description = ""
        ensemble = (self.meta or {}).get("ensemble")
        if not ensemble:
            return f"{self.method}: {description}" if description else self.method
        members = ensemble.get("members", len(ensemble.get("weights") or []))
        if not ensemble.get("normalize"):
            return f"ensemble scores: the weighted sum of {members} members' {self.method} scores (weights sum to 1)"
        bounded = "cosine" in description  # grad_cos, trackstar: the members' own scores are cosines
        return (f"normalised ensemble scores of {members} x {self.method}: each member's scores divided by their "
                "mean |score| (to a mean |score| of 1), then weighted (weights sum to 1); not "
                + ("cosines, not bounded by [-1, 1]" if bounded else f"{self.method} values"))

    @property
    def has_bottom(self) -> bool:
        """Whether the most harmful examples can be read: the matrix or a bottom-k was kept (an index search
        with ``bottom=False`` keeps the top-k only)."""
        return self.matrix is not None or self.bottom is not None

    def topk(self, k: int = 10, largest: bool = True) -> TopK:
        """The ``k`` most helpful (``largest=True``) or most harmful training examples of each query."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be a non-negative integer, got {k!r}")
        k = min(k, len(self.train_ids))
        if self.matrix is not None:
            values, indices = torch.topk(self.matrix, k, dim=1, largest=largest)
        else:
            kept = self.top if largest else self.bottom
            if kept is None and not largest and self.top is not None:
                raise ValueError("the lowest scores were not kept (scored with bottom=False, gradtrace score "
                                 "--no-bottom): score again without it, or with the full matrix")
            if kept is None or kept[0].shape[1] < k:
                have = 0 if kept is None else kept[0].shape[1]
                raise ValueError(f"only the top {have} {'highest' if largest else 'lowest'} scores were kept; "
                                 f"score again with topk={k} or with the full matrix")
            values, indices = kept[0][:, :k], kept[1][:, :k]
        ids = [[self.train_ids[j] for j in row] for row in indices.tolist()]
        return TopK(values, indices, ids)

    # -- pair attributions (meta["modules"] / meta["tokens"], shapes in docs/report.md) ------------------
    def _pair_record(self, key: str, query: str, train_id: str, computed_by: str) -> dict[str, Any]:
        records = self.meta.get(key)
        if not records:
            raise ScoresError(f"these scores hold no {key[:-1]}-level attributions: compute them with "
                              f"{computed_by}")
        for record in records:
            if record.get("query_id") == str(query) and record.get("train_id") == str(train_id):
                return record
        raise KeyError(f"no {key[:-1]}-level attribution for query {query!r} and training example {train_id!r}: only "
                       "the top and bottom k pairs of each query are decomposed")

    def modules(self, query: str, train_id: str) -> dict[str, float]:
        """The score of pair (``query``, ``train_id``) split by parameter block: ``{block name: share}``, summing
        to the pair's score (``gradtrace score --modules`` or :meth:`Attributor.module_scores`)."""
        record = self._pair_record("modules", query, train_id, "gradtrace score --modules or "
                                   "Attributor.module_scores(queries, scores)")
        return {str(name): float(value) for name, value in record["modules"].items()}

    def tokens(self, query: str, train_id: str) -> dict[str, Any]:
        """The score of pair (``query``, ``train_id``) split by token: ``{"query_tokens", "query_scores",
        "train_tokens", "train_scores"}`` (the sides that were computed), each side's scores summing to the pair's
        score (``gradtrace score --tokens`` or :meth:`Attributor.token_attributions`). From a bfloat16 or int8
        store the training side is re-captured in float32 and sums to the pair's float32 score, ``"train_score"``
        (a float, then also returned), rather than to the kept, quantized one."""
        record = self._pair_record("tokens", query, train_id, "gradtrace score --tokens or "
                                   "Attributor.token_attributions(queries, scores, ...)")
        out: dict[str, Any] = {key: list(value) for key, value in record.items()
                               if key.endswith(("_tokens", "_scores"))}
        if "train_score" in record:
            out["train_score"] = float(record["train_score"])
        return out

    # -- exports -----------------------------------------------------------------------------------
    def to_records(self, k: int | None = 10, largest: bool = True) -> list[dict[str, Any]]:
        """Long format rows ``{query_id, rank, train_id, score}``; ``k=None`` exports every pair."""
        rows = []
        if k is None:
            if self.matrix is None:
                raise ValueError("the full matrix was not kept: export the top k")
            for qi, qid in enumerate(self.query_ids):
                for ti, tid in enumerate(self.train_ids):
                    rows.append({"query_id": qid, "train_id": tid, "score": float(self.matrix[qi, ti])})
            return rows
        top = self.topk(k, largest)
        for qi, qid in enumerate(self.query_ids):
            for rank, (tid, value) in enumerate(zip(top.ids[qi], top.values[qi].tolist()), start=1):
                rows.append({"query_id": qid, "rank": rank, "train_id": tid, "score": value})
        return rows

    def to_pandas(self, k: int | None = 10, largest: bool = True):
        import pandas as pd

        return pd.DataFrame.from_records(self.to_records(k, largest))

    def to_csv(self, path: str | Path, k: int | None = 10, largest: bool = True) -> Path:
        path = Path(path)
        records = self.to_records(k, largest)
        with atomic_output(path) as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["query_id", "train_id", "score"])
            writer.writeheader()
            writer.writerows(records)
        return path

    def to_json(self, path: str | Path, k: int | None = 10, largest: bool = True) -> Path:
        path = Path(path)
        text = json.dumps({"method": self.method, "meta": self.meta, "scores": self.to_records(k, largest)}, indent=1)
        atomic_write_bytes(path, text.encode())
        return path

    def to_parquet(self, path: str | Path, k: int | None = 10, largest: bool = True) -> Path:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("Parquet export needs pyarrow: pip install 'gradtrace[export]'") from None
        path = Path(path)
        table = pa.Table.from_pylist(self.to_records(k, largest))
        table = table.replace_schema_metadata({"gradtrace": json.dumps({"method": self.method, "meta": self.meta})})
        with atomic_output(path) as tmp:
            pq.write_table(table, tmp)
        return path

    def export(self, path: str | Path, k: int | None = 10) -> Path:
        """Export by file extension: ``.csv``, ``.json``, ``.parquet``. Every export is written to a temporary file
        and renamed into place (a failure leaves an existing file as it was); a path inside a gradient store, or
        with the name of an artifact's file in an artifact's directory (``scores.json``), is refused
        (:func:`~gradtrace.store.artifact.refuse_inside_artifact`)."""
        refuse_inside_artifact(path, "the export", kinds=("a gradient store",))
        suffix = Path(path).suffix.lower()
        exporters = {".csv": self.to_csv, ".json": self.to_json, ".parquet": self.to_parquet}
        if suffix not in exporters:
            raise ValueError(f"unknown export format {suffix!r}: use .csv, .json or .parquet")
        return exporters[suffix](path, k)

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``path/scores.json`` (ids, method, meta, checksums) and ``path/scores-<hash>.safetensors``
        (tensors), atomically and under the directory's write lock: a failed save (a full disk raises
        :class:`OSError`) leaves previous scores in ``path`` intact, and a second process saving there at the same
        time is refused (``LockedError``). Scores already saved in ``path`` are replaced only with ``overwrite``
        (else :class:`~gradtrace.store.artifact.ArtifactExists`). The paths of the recorded configuration
        (``meta["config"]``: store, queries, model, ...) are written relative to ``path`` where they lie under or
        beside it, and read back against it by :meth:`load` (:func:`gradtrace.common.provenance.record_paths`): copied
        scores point at the copy's files."""
        tensors = {}
        if self.matrix is not None:
            tensors["matrix"] = self.matrix
        for name, kept in (("top", self.top), ("bottom", self.bottom)):
            if kept is not None:
                tensors[f"{name}_values"] = kept[0]
                tensors[f"{name}_indices"] = kept[1]
        meta = dict(self.meta)
        if isinstance(meta.get("config"), dict):
            meta["config"] = record_paths(meta["config"], path)
        info = {"method": self.method, "meta": meta, "query_ids": self.query_ids, "train_ids": self.train_ids}
        write_artifact(path, "scores", FORMAT, VERSION, info, tensors, overwrite=overwrite, what="scores")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Scores:
        """Load saved scores, verified (checksums of the manifest and tensors, shapes, finite values); raises
        :class:`ScoresError` naming the file (version-1 scores, saved without checksums, load with an
        ``UncheckedArtifactWarning``)."""
        path = Path(path)
        info, tensors = read_artifact(path, "scores", FORMAT, VERSION, what="scores", noun="score", error=ScoresError)
        unknown = sorted(set(tensors) - set(_TENSORS))
        if unknown:
            raise ScoresError(f"{path}: unknown tensors {unknown[:3]} in the saved scores")
        for name in ("top", "bottom"):
            if (f"{name}_values" in tensors) != (f"{name}_indices" in tensors):
                raise ScoresError(f"{path}: the saved {name}-k has values or indices missing; score again")
        try:
            ids = {key: info[key] for key in ("train_ids", "query_ids")}
            method, meta = str(info["method"]), dict(info.get("meta") or {})
        except (KeyError, TypeError, ValueError) as err:
            raise ScoresError(f"{path / 'scores.json'} is malformed ({err!r}); score again") from None
        if not all(isinstance(value, list) for value in ids.values()):
            raise ScoresError(f"{path / 'scores.json'} is malformed (train_ids and query_ids must be lists); score "
                              "again")
        if isinstance(meta.get("config"), dict):  # paths recorded relative to the scores' folder (older: absolute)
            meta["config"] = resolve_paths(meta["config"], path)
        kept = {name: (tensors[f"{name}_values"], tensors[f"{name}_indices"]) for name in ("top", "bottom")
                if f"{name}_values" in tensors}
        try:
            return cls(train_ids=ids["train_ids"], query_ids=ids["query_ids"], method=method,
                       matrix=tensors.get("matrix"), top=kept.get("top"), bottom=kept.get("bottom"), meta=meta)
        except ScoresError as err:
            raise ScoresError(f"{path}: {err}; score again") from None

    def __repr__(self) -> str:
        kept = "matrix" if self.matrix is not None else f"top {self.top[0].shape[1] if self.top else 0}"
        return f"Scores(method={self.method!r}, queries={len(self.query_ids)}, train={len(self.train_ids)}, {kept})"

    # -- report ------------------------------------------------------------------------------------
    def to_html(self, path: str | Path, texts: Any = None, queries: Any = None,
                options: ReportOptions | None = None, *, self_scores: Any = None,
                self_method: str | None = None) -> Path:
        """Write the HTML report of these scores to ``path``; returns the path. ``texts``, ``queries``, ``options``
        (what the page shows), ``self_scores`` and ``self_method`` are those of
        :func:`gradtrace.report.render_report`."""
        from ..report import render_report

        render_report(self, texts, queries, path, options, self_scores=self_scores, self_method=self_method)
        return Path(path)
