"""Tokenized examples ready for :func:`gradtrace.collect`: flat token and loss-mask arrays, ids, summary.

Examples are kept as one flat ``int32`` token array, one flat ``bool`` loss mask and per-example offsets
(a few bytes per token, no Python object per token). Iterating a :class:`TokenizedDataset` pads one batch
at a time, vectorized: ``{"input_ids": [B, T], "attention_mask": [B, T], "labels": [B, T], "id": [B]}``,
right-padded, ``labels`` = the token where it is in the loss and ``-100`` elsewhere (Hugging Face's
convention, read by :func:`gradtrace.losses.causal_lm_loss`). ``labels`` is left out when every token is in
the loss (plain text), which the loss then treats the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["DataSummary", "TokenizedDataset"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DataSummary:
    """What was read: counts for the one-line summary printed before collection."""

    source: str
    examples: int
    format: str
    conversational: bool
    loss_on: str
    loss_tokens: int
    total_tokens: int
    prompt_truncated: int
    cut: int
    id_field: str | None

    def line(self) -> str:
        """``train.parquet: 1,000 examples, prompt-completion, loss on completion: 4,321 of 9,876 tokens ...``."""
        kind = f"{self.format}{' (conversational)' if self.conversational else ''}"
        share = self.loss_tokens / max(self.total_tokens, 1)
        out = (f"{self.source}: {self.examples:,} examples, {kind}, loss on {self.loss_on}: {self.loss_tokens:,} of "
               f"{self.total_tokens:,} tokens ({share:.1%}), {self.prompt_truncated:,} truncated (prompt cut from the "
               "left)")
        if self.cut:
            out += f", {self.cut:,} cut to --max-length (--truncate)"
        return out + (f", ids from {self.id_field!r}" if self.id_field else ", content-hash ids")


class TokenizedDataset:
    """Tokenized, identified examples; iterating yields padded batches for :func:`gradtrace.collect`.

    Attributes:
        ids: one id per example, in order.
        summary: a :class:`DataSummary` (``summary.line()`` is the one-line summary).
        texts: each example's text for display (``load(..., keep_text=True)``), else None.
        batch_size: examples per batch; pad_id: the padding token.
    """

    def __init__(self, tokens: np.ndarray, loss: np.ndarray, lengths: np.ndarray, ids: list[str],
                 summary: DataSummary, *, batch_size: int, pad_id: int, texts: list[str] | None = None) -> None:
        self.tokens = tokens  # [N] int32
        self.loss = loss  # [N] bool
        self.lengths = lengths  # [E] int64
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [E + 1]
        self.ids = ids
        self.summary = summary
        self.texts = texts
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.masked = not bool(loss.all())

    def __len__(self) -> int:
        """Number of batches (for progress bars)."""
        return -(-len(self.ids) // self.batch_size)

    @property
    def num_examples(self) -> int:
        return len(self.ids)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [T] int64, in_loss [T] bool)`` of one example."""
        start, stop = self.offsets[index], self.offsets[index + 1]
        return self.tokens[start:stop].astype(np.int64), self.loss[start:stop].copy()

    def batch(self, start: int, stop: int) -> dict[str, Any]:
        """Examples ``start:stop`` as one right-padded batch."""
        lengths = self.lengths[start:stop]  # [B]
        width = int(lengths.max())
        columns = np.arange(width)
        valid = columns[None, :] < lengths[:, None]  # [B, T]
        index = np.where(valid, self.offsets[start:stop, None] + columns[None, :], 0)  # [B, T]
        input_ids = np.where(valid, self.tokens[index], self.pad_id).astype(np.int64)
        batch: dict[str, Any] = {"input_ids": torch.from_numpy(input_ids),
                                 "attention_mask": torch.from_numpy(valid.astype(np.int64))}
        if self.masked:
            labels = np.where(valid & self.loss[index], input_ids, IGNORE_INDEX)
            batch["labels"] = torch.from_numpy(labels)
        batch["id"] = list(self.ids[start:stop])
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self.ids), self.batch_size):
            yield self.batch(start, min(start + self.batch_size, len(self.ids)))

    def __repr__(self) -> str:
        return f"TokenizedDataset({self.summary.line()})"
