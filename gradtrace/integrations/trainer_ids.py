"""How example ids travel from a Hugging Face Trainer's training dataset to the capture.

The Trainer drops dataset columns its model does not take (``remove_unused_columns``), and collators
build batches only from the keys they know. So, for the duration of ``trainer.train()``:

1. the training dataset gets an internal column ``gradtrace_id``: its row index (``ids="index"``) or a
   copy of the user's id column (``ids="<column>"``);
2. that column is added to the Trainer's signature columns, so ``remove_unused_columns`` keeps it;
3. the data collator is wrapped by :class:`IdCollator`: it takes the column out of every feature, calls
   the user's collator on the rest, and puts the ids into the batch as a plain list;
4. the callback's ``compute_loss`` wrapper pops that list from the batch and gives it to the capture, and
   a forward pre-hook removes it from any other forward call, so the model never sees it.

:func:`prepare_ids` does steps 1-3 and returns a function that undoes them. Evaluation datasets are left
alone (their batches carry no ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["ID_KEY", "IdCollator", "prepare_ids"]

ID_KEY = "gradtrace_id"


def _plain(value: Any) -> Any:
    """A JSON-friendly scalar (tensors and NumPy scalars become Python values)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


class IdCollator:
    """Wraps a data collator: the ``gradtrace_id`` of each feature goes around it, into ``batch[key]``."""

    def __init__(self, collator: Callable[[list], Any], key: str = ID_KEY) -> None:
        self.collator = collator
        self.key = key

    def __call__(self, features: list) -> Any:
        ids = None
        if features and isinstance(features[0], Mapping) and self.key in features[0]:
            ids = [_plain(f[self.key]) for f in features]
            features = [{k: v for k, v in f.items() if k != self.key} for f in features]
        batch = self.collator(features)
        if ids is not None:
            batch[self.key] = ids
        return batch


class _KeyedDataset(torch.utils.data.Dataset):
    """A map-style dataset of dicts with ``gradtrace_id`` added: the index, or the value of ``column``."""

    def __init__(self, dataset: Any, column: str | None) -> None:
        self.dataset = dataset
        self.column = column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if not isinstance(item, Mapping):
            raise TypeError(f"gradtrace: training examples must be dicts to carry ids, got {type(item).__name__}; "
                            "pass ids=None to use content hashes")
        return {**item, ID_KEY: int(index) if self.column is None else item[self.column]}


class _KeyedIterable(torch.utils.data.IterableDataset):
    """An iterable dataset of dicts with ``gradtrace_id`` copied from ``column``."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset = dataset
        self.column = column

    def __iter__(self) -> Iterator[dict]:
        for item in self.dataset:
            yield {**item, ID_KEY: item[self.column]}


def _with_id_column(dataset: Any, ids: str) -> Any:
    """``dataset`` with the internal id column (see the module docstring)."""
    column = None if ids == "index" else ids
    try:
        import datasets
    except ImportError:  # pragma: no cover - transformers pulls it in for most users
        datasets = None
    if datasets is not None and isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        names = dataset.column_names
        if names is not None and ID_KEY in names:
            raise ValueError(f"gradtrace: the training dataset already has a column {ID_KEY!r}, which gradtrace uses "
                             "internally; rename it")
        if column is not None and names is not None and column not in names:
            raise ValueError(f"gradtrace: ids={column!r}: the training dataset has no such column (columns: "
                             f"{names})")
        if isinstance(dataset, datasets.IterableDataset):
            if column is None:
                raise ValueError("gradtrace: ids='index' needs a map-style training dataset (an IterableDataset has "
                                 "no row index); pass ids='<id column>', or ids=None for content hashes")
            return dataset.map(lambda example: {ID_KEY: example[column]})
        values = np.arange(len(dataset)) if column is None else dataset.with_format("arrow")[column]
        return dataset.add_column(ID_KEY, values)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        if column is None:
            raise ValueError("gradtrace: ids='index' needs a map-style training dataset (an IterableDataset has no "
                             "row index); pass ids='<id column>', or ids=None for content hashes")
        return _KeyedIterable(dataset, column)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(f"gradtrace: cannot attach ids to a training dataset of type {type(dataset).__name__}; "
                        "pass ids=None to use content hashes")
    return _KeyedDataset(dataset, column)


def prepare_ids(trainer: Any, ids: str, *, collate: bool = True) -> Callable[[], None]:
    """Make the ids reach the batches of ``trainer`` (steps 1-3 above); returns the undo function.

    ``collate=False`` leaves the data collator alone (step 3): for trainers whose batches are the features themselves
    (TRL's ``GRPOTrainer``: each feature keeps its ``gradtrace_id``, :mod:`.trl_grpo` takes it from there)."""
    if trainer.train_dataset is None:
        raise ValueError("gradtrace: the Trainer has no train_dataset")
    dataset, collator = trainer.train_dataset, trainer.data_collator
    keyed = _with_id_column(dataset, ids)
    added_signature = False
    if trainer.args.remove_unused_columns:
        trainer._set_signature_columns_if_needed()
        if ID_KEY not in trainer._signature_columns:
            trainer._signature_columns.append(ID_KEY)
            added_signature = True
    trainer.train_dataset = keyed
    if collate:
        trainer.data_collator = IdCollator(collator)

    def undo() -> None:
        trainer.train_dataset = dataset
        trainer.data_collator = collator
        if added_signature and trainer._signature_columns is not None and ID_KEY in trainer._signature_columns:
            trainer._signature_columns.remove(ID_KEY)

    return undo
