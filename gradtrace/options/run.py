"""How gradtrace runs data through the model in the passes it makes itself (collect, fits, plans)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..common.checks import check_fields

MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How batches go through the model in gradtrace's own passes (``collect``, ``fit_curvature``, ``plan``, the
    LESS features).

    Attributes:
        ids: one id per example, in order (not recorded in artifacts' option records: the store holds them); by
            default ``batch[id_key]`` when present, else content hashes.
        device: move each batch to this device first (None: where it is).
        eval_mode: run the model in eval mode (no dropout), restoring its mode afterwards.
        weight_grads: run a full ``backward()`` (parameter gradients computed too, then restored) instead of
            backpropagating to the captured layers' outputs only (about half the backward's cost).
        id_key: the batch key holding example ids (else content hashes).
        progress: show a progress bar; a string is its label.
        total: batches to expect when the data has no ``len`` (for the progress bar).
        model_dtype: the dtype of models gradtrace loads from model directories itself (``collect_checkpoints``):
            ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the dtype the checkpoint's config records).
    """

    ids: Sequence[Any] | None = field(default=None, metadata={"record": False})
    device: Any = None
    eval_mode: bool = True
    weight_grads: bool = False
    id_key: str = "id"
    progress: bool | str = False
    total: int | None = field(default=None, metadata={"min": 0})
    model_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {self.model_dtype!r}")
        check_fields(self)
