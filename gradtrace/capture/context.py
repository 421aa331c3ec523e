"""One forward call of the model: its rows, documents, example ids and loss scale.

Everything the capture needs to know about a batch is read from the root forward call (the
Hugging Face conventions: ``input_ids``, ``attention_mask``, ``position_ids``, ``labels``,
``num_items_in_batch``) or given explicitly with :meth:`Capture.annotate`. From it this module
derives, without Python loops over tokens:

* the *examples*: one per row, or one per document when rows are packed (``position_ids``
  restarts, as Hugging Face detects them, or an explicit document-id tensor), or one per group of
  rows (``row_examples``: a preference pair's chosen and rejected rows are one example);
* each example's *scale*: the factor that turns the hook gradients of the loop's loss into the
  gradient of the example's own loss (see :class:`gradtrace.LossConvention`);
* each example's *id*: a user-given id, else a content hash of its unpadded tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..data.ids import content_hash  # the one id rule, shared with gradtrace.data
from ..loss.functions import LossConvention

__all__ = ["BatchInfo", "ForwardContext", "call_context", "content_hash"]


@dataclass
class BatchInfo:
    """Per-batch facts a loop can state explicitly (each overrides what the forward call shows).

    ids: one id per example (per document when rows are packed).
    labels: ``[B, T]`` target tokens (``ignore_index`` = not a target) or ``[B]`` class labels.
    attention_mask: ``[B, T]``, 1 for real tokens.
    doc_ids: ``[B, T]`` document index of each token (packed rows).
    num_items: the denominator of a ``token_mean`` loss (e.g. ``num_items_in_batch``).
    row_examples: ``[B]`` example index of each row, for examples spanning several rows (a DPO pair: its chosen
        and rejected rows); the rows of one example are joined along the token axis in row order, their tokens
        (padding left out) one after another.
    example_scale: ``[E]`` each example's factor, given instead of the one the reduction derives (a loss whose
        normaliser differs per example, e.g. GRPO's per-completion token mean: ``rows * tokens of the completion``);
        still divided by the loss scale, and by the example's target count under ``example_loss="mean"``.
    """

    ids: Sequence[Any] | None = None
    labels: Tensor | None = None
    attention_mask: Tensor | None = None
    doc_ids: Tensor | None = None
    num_items: float | Tensor | None = None
    position_ids: Tensor | None = None
    row_examples: Tensor | None = None
    example_scale: Tensor | None = None


@dataclass(frozen=True)
class ContextSettings:
    convention: LossConvention
    loss_scale: float
    causal: bool
    ignore_index: int
    packing: bool


class ForwardContext:
    """Layout, scale and identity of the examples in one root forward call.

    Attributes:
        index: order of this call within the current step.
        batch_size: rows ``B``; seq_len: tokens ``T`` of token inputs (None for non-sequence inputs).
        num_examples: ``E`` (``B`` unless rows are packed or grouped).
        grouped: whether examples span several rows (``BatchInfo.row_examples``); they are then laid out as
            packed documents are (``packed`` is True too), each the concatenation of its rows' tokens.
        example_scale: ``[E]`` float32 scale of each example.
        num_targets: ``[E]`` target-token counts, or None when no labels are known.
    """

    def __init__(self, index: int, *, batch_size: int, seq_len: int | None, content: Tensor | None,
                 info: BatchInfo, settings: ContextSettings) -> None:
        self.index = index
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.content = content
        self.info = info
        self.settings = settings
        self.user_ids = list(info.ids) if info.ids is not None else None
        self.device = content.device if content is not None else torch.device("cpu")
        self._layout()
        self._scale()
        if self.user_ids is not None and len(self.user_ids) != self.num_examples:
            raise ValueError(f"{len(self.user_ids)} ids were given for a batch of {self.num_examples} examples"
                             + (" (documents of packed rows)" if self.packed else ""))

    # -- layout -------------------------------------------------------------------------------
    def _valid_mask(self) -> Tensor | None:
        mask = self.info.attention_mask
        if mask is None or self.seq_len is None:
            return None
        if mask.dim() != 2 or tuple(mask.shape) != (self.batch_size, self.seq_len):
            return None  # 4-d or otherwise custom masks do not mark padding per token
        return mask.to(self.device).bool()

    def _layout(self) -> None:
        B, T = self.batch_size, self.seq_len
        self.valid = self._valid_mask()  # [B, T] or None
        self.packed = False
        self.grouped = False
        self.num_examples = B
        if self.info.row_examples is not None:
            self._group_rows(self.info.row_examples)
            return
        starts = self._doc_starts()
        if starts is None or bool((starts.sum(1) <= 1).all()):
            return
        valid = self.valid if self.valid is not None else torch.ones(B, T, dtype=torch.bool, device=self.device)
        per_row = starts.sum(1)
        offsets = per_row.cumsum(0) - per_row
        doc_in_row = starts.long().cumsum(1) - 1
        example = torch.where(valid & (doc_in_row >= 0), offsets.unsqueeze(1) + doc_in_row, -1)
        positions = torch.arange(T, device=self.device).expand(B, T)
        start_pos = torch.where(starts, positions, torch.zeros_like(positions)).cummax(1).values
        self._token_layout(example, positions - start_pos, int(per_row.sum()))

    def _group_rows(self, row_examples: Tensor) -> None:
        """Examples of several rows (``row_examples``: ``[B]`` example of each row, every index in ``[0, E)`` used):
        an example's tokens are its rows' unpadded tokens, row after row."""
        B, T = self.batch_size, self.seq_len
        rows = torch.as_tensor(row_examples, device=self.device).long()
        if T is None:
            raise ValueError("row_examples (examples of several rows) needs token inputs ([rows, tokens] input_ids)")
        if rows.dim() != 1 or rows.shape[0] != B:
            raise ValueError(f"row_examples must hold one example index per row ([{B}]), got shape {tuple(rows.shape)}")
        if self.info.doc_ids is not None:
            raise ValueError("row_examples and doc_ids cannot be combined: an example is a group of rows or a "
                             "document of a packed row, not both")
        count = int(rows.max()) + 1 if B else 0
        if B and (int(rows.min()) < 0 or bool((torch.bincount(rows, minlength=count) == 0).any())):
            raise ValueError(f"row_examples must number the examples 0..E-1, each with a row, got {rows.tolist()}")
        valid = self.valid if self.valid is not None else torch.ones(B, T, dtype=torch.bool, device=self.device)
        lengths = valid.sum(1)  # [B] tokens of each row
        # tokens of the example's earlier rows: an exclusive cumulative sum of row lengths within each example
        order = torch.sort(rows, stable=True).indices
        ahead = lengths[order].cumsum(0) - lengths[order]  # [B] tokens of the rows before, in example order
        first = torch.zeros(count, dtype=ahead.dtype, device=self.device).scatter_reduce(
            0, rows[order], ahead, reduce="amin", include_self=False)
        offset = torch.empty_like(ahead)
        offset[order] = ahead - first[rows[order]]
        position = offset.unsqueeze(1) + valid.long().cumsum(1) - 1  # [B, T] position within the example
        example = torch.where(valid, rows.unsqueeze(1).expand(B, T), -1)
        self.grouped = True
        self._token_layout(example, position, count)

    def _token_layout(self, example: Tensor, position: Tensor, count: int) -> None:
        """Examples given token by token: ``example`` ``[B, T]`` (-1: none), ``position`` ``[B, T]`` within it."""
        self.packed = True
        self.num_examples = count
        self.example_of_token = example  # [B, T], -1 = not part of any example
        self.pos_in_example = position  # [B, T]
        keep = example >= 0
        self._flat_keep = keep.reshape(-1)
        self._flat_example = example.reshape(-1)[self._flat_keep]
        self._flat_pos = self.pos_in_example.reshape(-1)[self._flat_keep]
        self.example_len = int(self._flat_pos.max()) + 1 if self._flat_keep.any() else 1

    def _doc_starts(self) -> Tensor | None:
        """``[B, T]`` bool, True where a document starts; None when rows are not packed."""
        if self.seq_len is None:
            return None
        B, T = self.batch_size, self.seq_len
        doc_ids = self.info.doc_ids
        if doc_ids is not None:
            doc_ids = doc_ids.to(self.device)
            if tuple(doc_ids.shape) != (B, T):
                raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}, expected {(B, T)}")
            valid = self.valid if self.valid is not None else torch.ones(B, T, dtype=torch.bool, device=self.device)
            changed = torch.ones(B, T, dtype=torch.bool, device=self.device)
            changed[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]) | ~valid[:, :-1]
            return valid & changed
        pos = self.info.position_ids
        if not self.settings.packing or pos is None or T < 2:
            return None
        if self.valid is not None and not bool(self.valid.all()):
            return None  # like Hugging Face: packing is read from position_ids only without padding
        pos = pos.to(self.device)
        if pos.dim() != 2 or pos.shape[1] != T:
            return None
        pos = pos.expand(B, T)
        starts = torch.ones(B, T, dtype=torch.bool, device=self.device)
        starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
        return starts

    def relayout(self, x: Tensor) -> Tensor:
        """Map a per-row tensor ``[B, T', ...]`` to per-example ``[E, T_e, ...]``.

        Unpacked rows are examples already. Packed rows need token-level tensors (``T' == T``);
        index tensors are filled with ``-1`` and float tensors with 0 where an example is shorter.
        """
        if not self.packed:
            return x
        if x.shape[1] != self.seq_len:
            raise ValueError(
                f"a layer produced {x.shape[1]} positions per row, but the rows are packed documents of "
                f"{self.seq_len} tokens: its gradient cannot be split per document")
        fill = -1 if not x.is_floating_point() else 0
        out = x.new_full((self.num_examples, self.example_len, *x.shape[2:]), fill)
        flat = x.reshape(-1, *x.shape[2:])[self._flat_keep.to(x.device)]
        out[self._flat_example.to(x.device), self._flat_pos.to(x.device)] = flat
        return out

    # -- scale --------------------------------------------------------------------------------
    def _target_mask(self) -> Tensor | None:
        """``[B, T]`` (token labels) or ``[B, 1]`` (one label per row) bool: which positions carry a loss."""
        labels = self.info.labels
        if labels is None:
            return None
        labels = labels.to(self.device)
        ignore = self.settings.ignore_index
        if labels.dim() >= 2 and self.seq_len is not None and labels.shape[:2] == (self.batch_size, self.seq_len):
            mask = labels.reshape(self.batch_size, self.seq_len, -1)[..., 0] != ignore
            if self.settings.causal:  # logits at t predict labels[t + 1]
                mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
            return mask
        if labels.shape[0] == self.batch_size:
            flat = labels.reshape(self.batch_size, -1)
            if not flat.is_floating_point():
                return (flat != ignore).any(1, keepdim=True)
            return torch.ones(self.batch_size, 1, dtype=torch.bool, device=self.device)
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match a batch of {self.batch_size} rows")

    def _scale(self) -> None:
        conv = self.settings.convention
        targets = self._target_mask()
        self.num_targets = None
        if targets is not None:
            if self.packed:
                if targets.shape[1] != self.seq_len:
                    raise ValueError("packed rows need token-level labels")
                counts = torch.zeros(self.num_examples, device=self.device)
                keep = self.example_of_token >= 0
                counts.index_add_(0, self.example_of_token[keep], targets[keep].float())
            else:
                counts = targets.float().sum(1)
            self.num_targets = counts
        if self.info.example_scale is not None:
            factor = torch.as_tensor(self.info.example_scale).detach().to(self.device, torch.float32)
            if tuple(factor.shape) != (self.num_examples,):
                raise ValueError(f"example_scale must hold one factor per example ([{self.num_examples}]), got shape "
                                 f"{tuple(factor.shape)}")
        elif conv.reduction == "sum":
            factor = torch.tensor(1.0)
        elif conv.reduction == "mean":  # over the rows; over the examples when they span several rows
            factor = torch.tensor(float(self.num_examples if self.grouped else self.batch_size))
        elif conv.reduction == "token_mean":
            if self.info.num_items is not None:
                factor = torch.as_tensor(self.info.num_items, dtype=torch.float32).detach().cpu()
            elif targets is not None:
                factor = targets.float().sum().cpu()
            else:
                raise ValueError(
                    "reduction='token_mean' needs the number of target tokens: pass labels= to the model, or "
                    "cap.annotate(labels=...) / cap.annotate(num_items=...) before the forward call")
        else:  # pragma: no cover - validated by Capture
            raise ValueError(f"unknown reduction {conv.reduction!r}")
        factor = factor.to(torch.float32) / self.settings.loss_scale
        scale = factor.to(self.device).expand(self.num_examples).clone()
        if conv.example_loss == "mean":
            if self.num_targets is None:
                if self.seq_len is not None:
                    raise ValueError(
                        "example_loss='mean' needs each example's target tokens: pass labels= to the model or "
                        "cap.annotate(labels=...)")
                counts = torch.ones(self.num_examples, device=self.device)
            else:
                counts = self.num_targets
            scale = torch.where(counts > 0, scale / counts.clamp(min=1), torch.zeros_like(scale))
        self.example_scale = scale.to(torch.float32)

    def token_scale(self, num_tokens: int, device: torch.device) -> Tensor:
        """``[B, num_tokens]`` scale of each position (of a layer with ``num_tokens`` positions per row)."""
        if self.packed:
            if num_tokens != self.seq_len:
                raise ValueError(
                    f"a layer produced {num_tokens} positions per row, but the rows are packed documents of "
                    f"{self.seq_len} tokens: its gradient cannot be split per document")
            per_token = torch.where(self.example_of_token >= 0,
                                    self.example_scale[self.example_of_token.clamp(min=0)],
                                    torch.zeros((), device=self.device))
            return per_token.to(device)
        return self.example_scale.to(device).unsqueeze(1).expand(self.batch_size, num_tokens)

    @property
    def scales(self) -> TokenScales:
        """The per-token scale of this call as handed to layer handlers (see :class:`TokenScales`)."""
        return TokenScales(self)

    # -- identity -----------------------------------------------------------------------------
    def content_ids(self) -> list[str]:
        """Content hashes of each example's unpadded tokens (or of its input row)."""
        if self.content is None:
            raise ValueError("no input tensor to hash: give ids explicitly")
        content = self.content.detach().to("cpu")
        if self.seq_len is None or content.dim() < 2 or content.shape[1] != self.seq_len:
            rows = content.reshape(self.batch_size, -1).numpy()
            return [content_hash(row) for row in rows]
        tokens = content.reshape(self.batch_size, self.seq_len, -1).numpy()
        if self.packed:
            example = self.example_of_token.cpu().numpy()
            order = np.argsort(example.reshape(-1), kind="stable")
            flat_examples = example.reshape(-1)[order]
            flat_tokens = tokens.reshape(self.batch_size * self.seq_len, -1)[order]
            bounds = np.searchsorted(flat_examples, np.arange(self.num_examples + 1))
            return [content_hash(flat_tokens[bounds[i]:bounds[i + 1]]) for i in range(self.num_examples)]
        valid = self.valid.cpu().numpy() if self.valid is not None else None
        if valid is None:
            return [content_hash(row) for row in tokens]
        return [content_hash(row[mask]) for row, mask in zip(tokens, valid)]


def call_context(index: int, args: tuple, kwargs: dict, info: BatchInfo, settings: ContextSettings) -> ForwardContext:
    """The context of the model's forward call ``index`` on ``args`` / ``kwargs``: its batch is ``input_ids`` (or an
    integer first argument), else ``inputs_embeds``, else the first tensor; ``info``'s facts (:meth:`Capture.annotate`)
    win over the keyword arguments' ``labels``, ``attention_mask``, ``position_ids``, ``num_items_in_batch``."""
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args and isinstance(args[0], Tensor) and not args[0].is_floating_point():
        input_ids = args[0]
    embeds = kwargs.get("inputs_embeds")
    primary = input_ids if input_ids is not None else embeds
    if primary is None:
        primary = next((a for a in itertools.chain(args, kwargs.values()) if isinstance(a, Tensor)), None)
    if primary is None or primary.dim() == 0:
        raise ValueError("gradtrace: cannot find the batch in the model's forward arguments; "
                         "pass a tensor whose first dimension is the batch")
    seq_len = None
    if input_ids is not None and input_ids.dim() >= 2:
        seq_len = input_ids.shape[1]
    elif input_ids is None and embeds is not None and embeds.dim() >= 3:
        seq_len = embeds.shape[1]

    def pick(name: str, given: Any) -> Any:
        return given if given is not None else kwargs.get(name)

    num_items = info.num_items if info.num_items is not None else kwargs.get("num_items_in_batch")
    merged = BatchInfo(ids=info.ids, labels=pick("labels", info.labels),
                       attention_mask=pick("attention_mask", info.attention_mask), doc_ids=info.doc_ids,
                       num_items=num_items, position_ids=pick("position_ids", info.position_ids),
                       row_examples=info.row_examples, example_scale=info.example_scale)
    content = input_ids if input_ids is not None else primary
    return ForwardContext(index, batch_size=primary.shape[0], seq_len=seq_len, content=content, info=merged,
                          settings=settings)


class TokenScales:
    """The per-token loss scale of one forward call: callable as a ``TokenScale`` (``[B, num_tokens]``), and
    ``rows``: the ``[B]`` scale of each row's example when every token of a row belongs to that one example (rows
    not packed), else None. Handlers use ``rows`` to sum a row's tokens before projecting (exact, fewer products)."""

    def __init__(self, context: ForwardContext) -> None:
        self._context = context

    def __call__(self, num_tokens: int, device: torch.device) -> Tensor:
        return self._context.token_scale(num_tokens, device)

    @property
    def rows(self) -> Tensor | None:
        return None if self._context.packed else self._context.example_scale

    @property
    def outside(self) -> Tensor | None:
        """``[B, T]`` bool: the padding positions of unpacked token rows (None when rows are packed or have no
        padding mask); read without a host read."""
        context = self._context
        return None if context.packed or context.valid is None else ~context.valid
