"""``Scores``: attribution scores of queries against training examples, with top-k, save/load and exports.

Sign and units: a **positive score means the training example helps the query** (a gradient step on it
lowers the query's loss). Units depend on the method: ``grad_dot``/``tracin`` scores are products of
gradients (loss^2 per parameter^2, times a learning rate for TracIn), ``grad_cos`` scores are cosines.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Scores", "TopK"]

SIGN_CONVENTION = "positive = the training example helps the query (lowers its loss)"


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

    matrix: ``[Q, N]`` float32, or None when only the streaming top-k was kept (large stores).
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
        if self.matrix is not None and tuple(self.matrix.shape) != (len(self.query_ids), len(self.train_ids)):
            raise ValueError(f"matrix of shape {tuple(self.matrix.shape)} for {len(self.query_ids)} queries and "
                             f"{len(self.train_ids)} training examples")
        self.meta.setdefault("sign", SIGN_CONVENTION)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.query_ids), len(self.train_ids))

    def topk(self, k: int = 10, largest: bool = True) -> TopK:
        """The ``k`` most helpful (``largest=True``) or most harmful training examples of each query."""
        k = min(k, len(self.train_ids))
        if self.matrix is not None:
            values, indices = torch.topk(self.matrix, k, dim=1, largest=largest)
        else:
            kept = self.top if largest else self.bottom
            if kept is None or kept[0].shape[1] < k:
                have = 0 if kept is None else kept[0].shape[1]
                raise ValueError(f"only the top {have} {'highest' if largest else 'lowest'} scores were kept; "
                                 f"score again with topk={k} or with the full matrix")
            values, indices = kept[0][:, :k], kept[1][:, :k]
        ids = [[self.train_ids[j] for j in row] for row in indices.tolist()]
        return TopK(values, indices, ids)

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
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["query_id", "train_id", "score"])
            writer.writeheader()
            writer.writerows(records)
        return path

    def to_json(self, path: str | Path, k: int | None = 10, largest: bool = True) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"method": self.method, "meta": self.meta,
                                    "scores": self.to_records(k, largest)}, indent=1))
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
        pq.write_table(table, path)
        return path

    def export(self, path: str | Path, k: int | None = 10) -> Path:
        """Export by file extension: ``.csv``, ``.json``, ``.parquet``."""
        suffix = Path(path).suffix.lower()
        exporters = {".csv": self.to_csv, ".json": self.to_json, ".parquet": self.to_parquet}
        if suffix not in exporters:
            raise ValueError(f"unknown export format {suffix!r}: use .csv, .json or .parquet")
        return exporters[suffix](path, k)

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write ``path/scores.json`` (ids, method, meta) and ``path/scores.safetensors`` (tensors)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        if self.matrix is not None:
            tensors["matrix"] = self.matrix.contiguous().cpu()
        for name, kept in (("top", self.top), ("bottom", self.bottom)):
            if kept is not None:
                tensors[f"{name}_values"] = kept[0].contiguous().cpu()
                tensors[f"{name}_indices"] = kept[1].contiguous().cpu()
        save_file(tensors, str(path / "scores.safetensors"))
        info = {"format": "gradtrace-scores", "version": 1, "method": self.method, "meta": self.meta,
                "query_ids": self.query_ids, "train_ids": self.train_ids}
        (path / "scores.json").write_text(json.dumps(info, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Scores:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "scores.json").exists():
            raise FileNotFoundError(f"{path} holds no saved scores (scores.json missing)")
        info = json.loads((path / "scores.json").read_text())
        if info.get("format") != "gradtrace-scores":
            raise ValueError(f"{path} is not a gradtrace score file")
        tensors = load_file(str(path / "scores.safetensors"))
        kept = {name: (tensors[f"{name}_values"], tensors[f"{name}_indices"]) for name in ("top", "bottom")
                if f"{name}_values" in tensors}
        return cls(train_ids=info["train_ids"], query_ids=info["query_ids"], method=info["method"],
                   matrix=tensors.get("matrix"), top=kept.get("top"), bottom=kept.get("bottom"), meta=info["meta"])

    def __repr__(self) -> str:
        kept = "matrix" if self.matrix is not None else f"top {self.top[0].shape[1] if self.top else 0}"
        return f"Scores(method={self.method!r}, queries={len(self.query_ids)}, train={len(self.train_ids)}, {kept})"

    # -- report ------------------------------------------------------------------------------------
    def to_html(self, path: str | Path, texts: Any = None, queries: Any = None, **options: Any) -> Path:
        """Write the HTML report of these scores to ``path`` (see :func:`gradtrace.report.render_report` for
        ``texts``, ``queries`` and the options); returns the path."""
        from ..report import render_report

        render_report(self, texts=texts, queries=queries, out=path, **options)
        return Path(path)
