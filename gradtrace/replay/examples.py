"""The training examples of a recorded run, saved as the data collator gave them, and rebuilt bit for bit.

:func:`gradtrace.replay.hf.record_trainer` hands every training micro-batch to an :class:`ExampleRecorder`, which
keeps, once per example id, its row of every tensor of the batch with a batch dimension (``input_ids``,
``attention_mask``, ``labels``, ...), unpadded to its attention length, and, per micro-batch, the padded width, the
padding side and the value each tensor was padded with. :func:`load_examples` reads them back as the replay's
``batches(ids)``: for the ids of a recorded micro-batch it returns the very tensors the Trainer's ``compute_loss``
received (same values, dtypes and shapes); for other ids (a query made of training examples), one batch padded on
the run's side with its pad values.

Files under the run directory: ``examples.safetensors`` (per tensor name ``K``: ``K.values``, the example rows
concatenated, int32 where an int64 tensor fits, and ``K.offsets`` ``[E + 1]``) and ``examples.json`` (schema
``gradtrace.replay.examples/1``: the example ids in row order, each tensor's dtype and kind, the distinct paddings
and, per micro-batch in training order, its ids, width and padding).

Refused at record time (``ReplayError``): a batch value that is not a tensor (other than the ids), a tensor of more
than 2 dimensions, an attention mask that is neither left- nor right-padding, padding that is not one value per
tensor in a micro-batch, and an example whose rows differ between two micro-batches (a random collator, e.g.
masking for MLM).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .spec import ReplayError
from .weights import read_tensors, write_tensors

__all__ = ["EXAMPLES_SCHEMA", "ExampleRecorder", "RecordedExamples", "has_examples", "load_examples"]

EXAMPLES_SCHEMA = "gradtrace.replay.examples/1"
_INT32 = (-(2**31), 2**31 - 1)


def _row_layout(mask: Tensor | None, width: int) -> tuple[list[int], str]:
    """Each row's length and the padding side (``right``/``left``) from an attention mask ``[B, T]``."""
    if mask is None:
        return [width], "right"
    valid = mask != 0
    lengths = valid.sum(1)
    columns = torch.arange(width)
    right = torch.equal(valid, columns[None, :] < lengths[:, None])
    left = torch.equal(valid, columns[None, :] >= (width - lengths)[:, None])
    if not (right or left):
        raise ReplayError("record_trainer: an attention mask that is neither right- nor left-padding (packed or "
                          "holed sequences) cannot be saved as examples; pass examples=False and give batches(ids) "
                          "yourself")
    return lengths.tolist(), "right" if right else "left"


class ExampleRecorder:
    """Collects the micro-batches of a run (:meth:`add`) and writes them (:meth:`save`)."""

    def __init__(self) -> None:
        self.rows: dict[Any, dict[str, Tensor]] = {}  # id -> key -> its unpadded row
        self.kinds: dict[str, dict[str, Any]] = {}  # key -> {"dtype", "seq"}
        self.paddings: list[dict[str, Any]] = []
        self.micro: list[dict[str, Any]] = []

    def add(self, ids: Sequence[Any], batch: Mapping[str, Any]) -> None:
        """Keep one micro-batch: ``batch`` the collator's tensors (``[B]`` or ``[B, T]``), ``ids`` its example ids.

        Raises:
            ReplayError: what the module docstring lists.
        """
        ids, size = list(ids), len(ids)
        tensors: dict[str, Tensor] = {}
        for key, value in batch.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != size:
                raise ReplayError(f"record_trainer: batch value {key!r} is not a tensor with a batch dimension of "
                                  f"{size}; pass examples=False and give batches(ids) yourself")
            if value.dim() > 2:
                raise ReplayError(f"record_trainer: batch tensor {key!r} has shape {tuple(value.shape)}: only [B] "
                                  "and [B, T] tensors are saved as examples; pass examples=False")
            tensors[key] = value.detach().to("cpu")
        mask = tensors.get("attention_mask")
        mask = mask if mask is not None and mask.dim() == 2 else None
        two_dim = [t for t in tensors.values() if t.dim() == 2]
        width = mask.shape[1] if mask is not None else (two_dim[0].shape[1] if two_dim else 0)
        lengths, side = _row_layout(mask, width) if width else ([0], "right")
        lengths = lengths * size if len(lengths) == 1 else lengths
        pad: dict[str, int | float] = {}
        for key, tensor in tensors.items():
            seq = tensor.dim() == 2 and tensor.shape[1] == width
            kind = {"dtype": str(tensor.dtype).removeprefix("torch."), "seq": seq}
            if self.kinds.setdefault(key, kind) != kind:
                raise ReplayError(f"record_trainer: batch tensor {key!r} changed from {self.kinds[key]} to {kind}")
            if seq and mask is not None:
                padded = tensor[mask == 0]
                if padded.numel():
                    if not bool((padded == padded[0]).all()):
                        raise ReplayError(f"record_trainer: the padding of batch tensor {key!r} is not one value; "
                                          "pass examples=False and give batches(ids) yourself")
                    pad[key] = padded[0].item()
        for b, ident in enumerate(ids):
            row = {}
            for key, tensor in tensors.items():
                if not self.kinds[key]["seq"]:
                    row[key] = tensor[b].clone()
                elif side == "right":
                    row[key] = tensor[b, :lengths[b]].clone()
                else:
                    row[key] = tensor[b, width - lengths[b]:].clone()
            known = self.rows.setdefault(ident, row)
            if known is not row and (known.keys() != row.keys()
                                     or not all(torch.equal(known[k], row[k]) for k in row)):
                raise ReplayError(f"record_trainer: example {ident!r} reached the model with other values at another "
                                  "step (a random collator?): its batches cannot be saved; pass examples=False")
        padding = {"side": side, "pad": pad}
        if padding not in self.paddings:
            self.paddings.append(padding)
        self.micro.append({"ids": ids, "width": width, "padding": self.paddings.index(padding)})

    def save(self, run_dir: Path) -> None:
        """Write ``examples.safetensors`` and ``examples.json`` under ``run_dir`` (atomically)."""
        order = list(self.rows)
        tensors: dict[str, Tensor] = {}
        kinds = {}
        for key, kind in self.kinds.items():
            rows = [self.rows[i][key].reshape(-1) for i in order]
            values = torch.cat(rows) if rows else torch.zeros(0)
            stored = kind["dtype"]
            if values.dtype == torch.int64 and (not values.numel() or (_INT32[0] <= int(values.min())
                                                and int(values.max()) <= _INT32[1])):
                values, stored = values.to(torch.int32), "int32"
            lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
            tensors[f"{key}.values"] = values
            tensors[f"{key}.offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            kinds[key] = {**kind, "stored": stored}
        write_tensors(run_dir / "examples", tensors)
        info = {"schema": EXAMPLES_SCHEMA, "ids": order, "tensors": kinds, "paddings": self.paddings,
                "micro_batches": self.micro}
        tmp = run_dir / "examples.json.tmp"
        tmp.write_text(json.dumps(info, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, run_dir / "examples.json")


def has_examples(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds saved examples (:func:`load_examples` reads them)."""
    return (Path(run_dir) / "examples.json").exists()


class RecordedExamples:
    """The saved examples of a run: call it with ids for a batch (``batches(ids)``), or read one example's rows."""

    def __init__(self, info: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.ids: list[Any] = info["ids"]
        self.position = {ident: i for i, ident in enumerate(self.ids)}
        self.kinds: dict[str, dict[str, Any]] = info["tensors"]
        self.paddings: list[dict[str, Any]] = info["paddings"]
        self.layouts = {tuple(m["ids"]): (m["width"], self.paddings[m["padding"]]) for m in info["micro_batches"]}
        self.values = {k: tensors[f"{k}.values"].to(getattr(torch, kind["dtype"])) for k, kind in self.kinds.items()}
        self.offsets = {k: tensors[f"{k}.offsets"].tolist() for k in self.kinds}
        padded = [p for p in self.paddings if p["pad"]]
        self.default = padded[0] if padded else {"side": "right", "pad": {}}

    def row(self, ident: Any, key: str) -> Tensor:
        """Example ``ident``'s row of tensor ``key`` (unpadded; a scalar for a ``[B]`` tensor)."""
        try:
            index = self.position[ident]
        except KeyError:
            raise ReplayError(f"example id {ident!r} is not among the run's saved examples") from None
        start, stop = self.offsets[key][index], self.offsets[key][index + 1]
        row = self.values[key][start:stop]
        return row if self.kinds[key]["seq"] else row.reshape(())

    def __call__(self, ids: Sequence[Any]) -> dict[str, Tensor]:
        """The batch of ``ids``, in that order: a recorded micro-batch's exact tensors, else padded on the run's
        side with its pad values to the longest row."""
        ids = list(ids)
        width, padding = self.layouts.get(tuple(ids), (None, self.default))
        batch = {}
        for key, kind in self.kinds.items():
            rows = [self.row(i, key) for i in ids]
            if not kind["seq"]:
                batch[key] = torch.stack(rows)
                continue
            longest = width if width is not None else max(r.numel() for r in rows)
            if any(r.numel() < longest for r in rows) and key not in padding["pad"]:
                raise ReplayError(f"examples {ids[:5]}: rows of {key!r} of different lengths and no recorded pad "
                                  "value to pad them with")
            out = torch.full((len(ids), longest), padding["pad"].get(key, 0), dtype=rows[0].dtype)
            for b, r in enumerate(rows):
                if padding["side"] == "right":
                    out[b, :r.numel()] = r
                else:
                    out[b, longest - r.numel():] = r
            batch[key] = out
        return batch


def load_examples(run_dir: str | Path) -> Callable[[Sequence[Any]], dict[str, Tensor]]:
    """The replay's ``batches(ids)`` from the examples :func:`gradtrace.replay.hf.record_trainer` saved.

    Args:
        run_dir: the run directory.

    Returns:
        a :class:`RecordedExamples`: ``batches(ids) -> {name: tensor}``.

    Raises:
        ReplayError: no saved examples, or another schema.
    """
    run_dir = Path(run_dir)
    if not has_examples(run_dir):
        raise ReplayError(f"{run_dir}: no saved examples (examples.json): the run was not recorded by "
                          "record_trainer with examples=True")
    info = json.loads((run_dir / "examples.json").read_text(encoding="utf-8"))
    if info.get("schema") != EXAMPLES_SCHEMA:
        raise ReplayError(f"{run_dir / 'examples.json'}: schema {info.get('schema')!r}, expected {EXAMPLES_SCHEMA!r}")
    stem = next((run_dir / f"examples{s}" for s in (".safetensors", ".pt") if (run_dir / f"examples{s}").exists()),
                None)
    if stem is None:
        raise ReplayError(f"{run_dir}: examples.json without examples.safetensors")
    return RecordedExamples(info, read_tensors(stem))
