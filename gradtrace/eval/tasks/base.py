"""The task protocol of the quality harness: data, a deterministic training recipe and the queries' outcome.

A task fixes everything an LDS ground truth depends on -- the training examples (with ids), the queries,
the per-example loss, and ``train(indices, seed)``, which retrains the model from scratch on a subset of
the training examples. ``model`` is the model trained on all of them (seed ``settings.seed``), the one
whose gradients are attributed. ``config`` describes all of it for cache fingerprints.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["Task", "fresh_model", "minibatch_epochs", "tensor_digest"]


def tensor_digest(*tensors: Tensor) -> str:
    """sha256 (16 hex digits) of the tensors' dtypes, shapes and bytes: a fingerprint of a task's data."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:16]


def fresh_model(indices: Tensor, seed: int, build: Callable[[], nn.Module]) -> tuple[Tensor, nn.Module]:
    """The start of :meth:`Task.train`: ``indices`` as a long tensor (an empty subset is refused) and ``build()``'s
    model, initialised under ``seed`` without disturbing the global random state."""
    indices = torch.as_tensor(indices, dtype=torch.long)
    if indices.numel() == 0:
        raise ValueError("cannot train on an empty subset")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return indices, build()


def minibatch_epochs(model: nn.Module, indices: Tensor, seed: int, optimizer: torch.optim.Optimizer, *, epochs: int,
                     batch_size: int, batch_loss: Callable[[Tensor], Tensor],
                     on_epoch: Callable[[int, nn.Module], None] | None = None) -> nn.Module:
    """The mini-batch loop of :meth:`Task.train`: ``epochs`` passes over ``indices`` (``[N]`` training rows),
    shuffled by a generator seeded with ``seed``, one ``optimizer`` step per batch of ``batch_size`` rows on
    ``batch_loss(rows)`` (a scalar); ``on_epoch(epoch, model)`` after each epoch (1-based). Returns ``model`` in
    eval mode."""
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for epoch in range(epochs):
        order = indices[torch.randperm(indices.numel(), generator=generator)]
        for start in range(0, order.numel(), batch_size):
            loss = batch_loss(order[start:start + batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if on_epoch is not None:
            on_epoch(epoch + 1, model)
    return model.eval()


class Task(abc.ABC):
    """A training-data-attribution evaluation task.

    Subclasses set ``name`` and ``version`` (bump it when the recipe changes in a way ``settings`` does not
    show) and implement the data, :meth:`train` and :meth:`loss_fn`.

    Attributes:
        settings: the task's dataclass of settings (sizes, model, training recipe, seeds).
    """

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self._model: nn.Module | None = None

    # -- data --------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def train_ids(self) -> list[str]:
        """One id per training example, in index order (column ``i`` of LDS masks and score matrices)."""

    @property
    @abc.abstractmethod
    def query_ids(self) -> list[str]:
        """One id per query, in the order of :meth:`outcome`."""

    @property
    def num_train(self) -> int:
        return len(self.train_ids)

    @property
    def num_queries(self) -> int:
        return len(self.query_ids)

    @abc.abstractmethod
    def train_batches(self, batch_size: int | None = None) -> list[Any]:
        """The training examples in index order, as batches for :func:`gradtrace.collect` (with ``"id"``)."""

    @abc.abstractmethod
    def query_batches(self) -> list[Any]:
        """The queries in order, as batches for :func:`gradtrace.collect` (with ``"id"``)."""

    @abc.abstractmethod
    def data_digest(self) -> str:
        """A fingerprint of the task's data (so a changed corpus or split invalidates cached ground truth)."""

    # -- model -------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def loss_fn(self) -> Callable[[nn.Module, Any], Tensor]:
        """``loss_fn(model, batch) -> [B]`` per-example losses (the loss attributed and the query outcome)."""

    @abc.abstractmethod
    def train(self, indices: Tensor, seed: int) -> nn.Module:
        """A model trained from scratch on the training examples ``indices`` (``[m]`` long) with training seed
        ``seed``; deterministic given both. Returned in eval mode."""

    @property
    def model(self) -> nn.Module:
        """The model trained on all the training examples with seed ``settings.seed`` (trained once, cached)."""
        if self._model is None:
            self._model = self.train(torch.arange(self.num_train), self.settings.seed)
        return self._model

    def checkpoint_epochs(self, count: int, after: float = 0.0) -> list[int]:
        """The epochs :meth:`checkpoints` saves after, ascending: ``round(k * epochs / count)``, ``k = 1..count``;
        with ``after`` (a fraction of the run in [0, 1)), ``start + round(k * (epochs - start) / count)``,
        ``start = round(after * epochs)``."""
        epochs = getattr(self.settings, "epochs", None)
        if epochs is None:
            raise ValueError(f"task {self.name!r} has no epoch schedule to save checkpoints along")
        if isinstance(after, bool) or not isinstance(after, (int, float)) or not 0.0 <= after < 1.0:
            raise ValueError(f"after must be a fraction of the run in [0, 1), got {after!r}")
        start = round(after * epochs)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= epochs - start:
            raise ValueError(f"count must be an integer in 1..{epochs - start} (the epochs of {self.name} after "
                             f"epoch {start}), got {count!r}")
        return sorted({start + round(k * (epochs - start) / count) for k in range(1, count + 1)})

    def checkpoints(self, count: int, after: float = 0.0) -> list[nn.Module]:
        """The training run of :attr:`model` (all the training examples, seed ``settings.seed``) saved at ``count``
        evenly spaced points of its schedule, the last at its end (``model``'s weights): after the epochs of
        :meth:`checkpoint_epochs`. For tasks whose ``train`` takes ``on_epoch``."""
        at = set(self.checkpoint_epochs(count, after))
        saved: list[nn.Module] = []

        def keep(epoch: int, model: nn.Module) -> None:
            if epoch in at:
                saved.append(copy.deepcopy(model).eval())

        self.train(torch.arange(self.num_train), self.settings.seed, on_epoch=keep)
        return saved

    @torch.no_grad()
    def outcome(self, model: nn.Module) -> Tensor:
        """``[Q]``: ``-loss`` of each query under ``model`` (higher = better, the sign of attribution scores)."""
        was_training = model.training
        model.eval()
        try:
            losses = [self.loss_fn(model, _without_ids(batch)) for batch in self.query_batches()]
        finally:
            model.train(was_training)
        return -torch.cat(losses).to(torch.float64)

    # -- description -------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """Everything the task's outcomes depend on, JSON-serialisable (cache fingerprints use it)."""
        return {"task": self.name, "version": self.version, "settings": dataclasses.asdict(self.settings),
                "data": self.data_digest()}

    def describe(self) -> str:
        """One line for reports."""
        return f"{self.name}: {self.num_train} training examples, {self.num_queries} queries"


def _without_ids(batch: Any) -> Any:
    return {k: v for k, v in batch.items() if k != "id"} if isinstance(batch, dict) else batch
