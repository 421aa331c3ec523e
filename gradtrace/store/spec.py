"""What makes two sets of per-example gradients comparable, and a model's fingerprint.

A :class:`GradientSpec` travels with every store and in-memory gradient set: the parameters and their
(flattened, possibly projected) dimensions in order, the projection spec, the loss convention, the
storage dtype and the model's fingerprint. Scoring a query set against a store checks that the two
specs agree and names the field that does not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ..grad.batch import GradientBatch

__all__ = ["GradientSpec", "IdCollision", "SpecMismatch", "fingerprint_like", "first_occurrences", "model_fingerprint",
           "resume_mismatch", "weights_comparable"]


class SpecMismatch(ValueError):
    """Two gradient sets (stores, query sets, curvature) come from different models, layers or projections."""


class IdCollision(ValueError):
    """Two different examples (different content digests) were given the same id, or ids of different types
    (``1`` and ``"1"``) that would become the same string."""


def first_occurrences(ids: Sequence[str], digests: Sequence[str | None] | None,
                      known: Callable[[str], tuple[bool, str | None]], where: Callable[[str], str]
                      ) -> tuple[list[int], dict[str, str | None], list[str]]:
    """The one rule by which stores and in-memory gradient sets keep each id once.

    ``ids``/``digests``: the rows offered (``digests``: each row's content digest, None where unknown);
    ``known(id) -> (kept before, its digest)``; ``where(id)``: where the kept row came from, for the error.
    Returns the positions of the rows to keep (first occurrence of an id not kept before), ``{id: digest}`` of
    those rows, and the ids of the rows that were repeats (same id, same digest or no digest on either side). An id
    offered with another digest than the kept one raises :class:`IdCollision` before anything is returned.
    """
    if digests is not None and len(digests) != len(ids):
        raise ValueError(f"{len(digests)} digests for {len(ids)} ids")
    keep: list[int] = []
    new: dict[str, str | None] = {}
    repeats: list[str] = []
    for pos, ident in enumerate(ids):
        digest = digests[pos] if digests is not None else None
        if ident in new:
            seen, other, origin = True, new[ident], "offered earlier"
        else:
            (seen, other), origin = known(ident), None
        if not seen:
            new[ident] = digest
            keep.append(pos)
            continue
        if digest is not None and other is not None and digest != other:
            raise IdCollision(f"id {ident!r} names two different examples (content digests {other} and {digest}; "
                              f"the first {origin or where(ident)}): give every example its own id")
        repeats.append(ident)
    return keep, new, repeats


def model_fingerprint(model: nn.Module, *, scheme: str | None = None) -> dict[str, str]:
    """``{"class", "arch", "weights", "scheme"}``: the model class, a hash of parameter names/shapes/dtypes, and a
    digest of every parameter's bits (:func:`~gradtrace.store.weights_digest.weights_digest`: the same on a CPU
    and a GPU, whatever the memory layout; tells checkpoints apart), named by ``scheme``.

    Parameters sharded by FSDP2 (DTensors) are digested where they live, shard by shard, and the partial digests
    all-reduced, so the fingerprint equals the unsharded model's: a collective, which every rank must call (the
    store writer and ``collect`` do). ``scheme="legacy"``: the digest of fingerprints written without a scheme
    (:func:`~gradtrace.store.weights_digest.legacy_weights_digest`; it gathers sharded parameters), to compare
    with such a store (:func:`fingerprint_like`)."""
    from ..common.modules import strip_wrappers, unwrap
    from .weights_digest import SCHEME, legacy_weights_digest, weights_digest

    if scheme not in (None, SCHEME, "legacy"):
        raise ValueError(f"unknown fingerprint scheme {scheme!r}; expected {SCHEME!r} or 'legacy'")
    inner = unwrap(model)
    arch = hashlib.blake2b(digest_size=8)
    params = []
    for name, param in inner.named_parameters():
        arch.update(f"{strip_wrappers(name)}|{tuple(param.shape)}|{param.dtype}\n".encode())
        params.append(param)
    cls = type(inner)
    if any(base.__name__ == "FSDPModule" for base in cls.__bases__):  # FSDP2's FSDP<class>: name the model's own
        cls = next(base for base in cls.__bases__ if base.__name__ != "FSDPModule")
    out = {"class": cls.__name__, "arch": arch.hexdigest()}
    if scheme == "legacy":
        return {**out, "weights": legacy_weights_digest(params)}
    return {**out, "weights": weights_digest(params), "scheme": SCHEME}


def fingerprint_like(model: nn.Module, stored: dict[str, str] | None) -> dict[str, str]:
    """``model``'s fingerprint computed the way ``stored`` (a store's recorded fingerprint) was: the legacy digest
    for a fingerprint without a ``scheme`` (so that a store written before the scheme can be resumed with the same
    weights), else the current one. A collective under FSDP2, as :func:`model_fingerprint`."""
    legacy = bool(stored) and bool(stored.get("weights")) and "scheme" not in stored
    return model_fingerprint(model, scheme="legacy" if legacy else None)


def weights_comparable(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether two fingerprints' weights digests can be compared: both have one, by the same scheme."""
    return bool(a.get("weights")) and bool(b.get("weights")) and a.get("scheme") == b.get("scheme")


@dataclass
class GradientSpec:
    """Layout and provenance of per-example gradient vectors.

    params: ``[(parameter name, flattened dim), ...]`` in vector order.
    projection: the projection spec dict (None: exact gradients).
    convention: ``{"reduction", "example_loss"}``.
    model: :func:`model_fingerprint` of the model the gradients were taken from.
    dtype: storage format of the vectors: ``"float32"``, ``"bfloat16"`` or ``"int8"``.
    """

    params: list[tuple[str, int]]
    projection: dict[str, Any] | None
    convention: dict[str, str]
    model: dict[str, str] = field(default_factory=dict)
    dtype: str = "float32"

    @classmethod
    def from_batch(cls, batch: GradientBatch, *, model: dict[str, str] | None = None,
                   dtype: str = "float32") -> GradientSpec:
        """The layout of ``batch``'s flattened gradients: its parameters and dims, projection and loss convention;
        ``model``: the :func:`model_fingerprint` to record, ``dtype``: the storage dtype."""
        return cls(params=list(batch.dims.items()), projection=batch.projection,
                   convention=batch.convention.to_dict(), model=dict(model or {}), dtype=dtype)

    def check_batch(self, batch: GradientBatch, what: str) -> None:
        """Raise :class:`SpecMismatch` unless ``batch`` has this layout (parameters, dims, projection); ``what``
        ends the message: ``"... another projection than {what}"``."""
        if list(batch.dims.items()) != self.params or batch.projection != self.projection:
            raise SpecMismatch(f"gradtrace: backward pass {batch.step} captured other parameters or another "
                               f"projection than {what}")

    @property
    def dim(self) -> int:
        return sum(d for _, d in self.params)

    def offsets(self) -> dict[str, tuple[int, int]]:
        """``name -> (start, stop)`` of each parameter's slice of a vector."""
        out, start = {}, 0
        for name, dim in self.params:
            out[name] = (start, start + dim)
            start += dim
        return out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["params"] = [[n, d] for n, d in self.params]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradientSpec:
        return cls(params=[(str(n), int(d)) for n, d in data["params"]], projection=data.get("projection"),
                   convention=dict(data.get("convention") or {}), model=dict(data.get("model") or {}),
                   dtype=data.get("dtype", "float32"))

    def check_compatible(self, other: GradientSpec, what: str = "these gradients", *,
                         same_weights: bool = False) -> None:
        """Raise :class:`SpecMismatch` naming the first difference that makes the two incomparable.

        The storage dtype may differ (vectors are dequantized to float32 to be compared). Different
        weights of the same architecture (checkpoints) are allowed unless ``same_weights``.
        """
        mine, theirs = self.model, other.model
        if mine.get("arch") and theirs.get("arch") and mine["arch"] != theirs["arch"]:
            raise SpecMismatch(f"{what}: made by another model ({mine.get('class')} {mine['arch']} vs "
                               f"{theirs.get('class')} {theirs['arch']}: parameter names/shapes differ)")
        if same_weights and mine.get("weights") != theirs.get("weights"):
            if mine.get("weights") and theirs.get("weights") and mine.get("scheme") != theirs.get("scheme"):
                raise SpecMismatch(f"{what}: their weights fingerprints were computed by different schemes "
                                   f"({mine.get('scheme', 'legacy')} vs {theirs.get('scheme', 'legacy')}) and cannot "
                                   "be compared; fingerprint the model with fingerprint_like(model, stored)")
            raise SpecMismatch(f"{what}: made with different weights "
                               f"({mine.get('weights')} vs {theirs.get('weights')})")
        if self.projection != other.projection:
            raise SpecMismatch(f"{what}: different projections ({self.projection} vs {other.projection})")
        if self.params != other.params:
            names_a = [n for n, _ in self.params]
            names_b = [n for n, _ in other.params]
            if names_a != names_b:
                only_a = [n for n in names_a if n not in names_b][:3]
                only_b = [n for n in names_b if n not in names_a][:3]
                raise SpecMismatch(f"{what}: different captured parameters (only in one: {only_a}; only in the "
                                   f"other: {only_b}{'' if only_a or only_b else '; order differs'})")
            bad = [(n, d, e) for (n, d), (_, e) in zip(self.params, other.params) if d != e][:3]
            raise SpecMismatch(f"{what}: different dimensions for {bad}")
        # the loop's reduction is removed at capture; what must agree is the loss each gradient belongs to
        mine_loss, their_loss = self.convention.get("example_loss"), other.convention.get("example_loss")
        if mine_loss != their_loss:
            raise SpecMismatch(f"{what}: different loss conventions (gradients of the per-example {mine_loss!r} "
                               f"loss vs the {their_loss!r} loss)")


def resume_mismatch(stored: GradientSpec, *, model: dict[str, str] | None = None,
                    projection: dict[str, Any] | bool | None = False, example_loss: str | None = None,
                    dtype: str | None = None, describe: Callable[[Any], str] = str) -> str | None:
    """What makes a run unable to add rows to a store of spec ``stored`` (None: nothing), checked before any
    gradient is taken: the model (architecture, then weights: ``model`` is a :func:`model_fingerprint`), the
    projection (its spec dict, None for exact gradients; ``False``: not checked), the per-example loss and the
    storage dtype. Arguments left out are not checked; ``describe`` writes a projection spec for the message."""
    theirs = stored.model
    if model is not None:
        if theirs.get("arch") and model.get("arch") and theirs["arch"] != model["arch"]:
            return (f"it was collected with another model ({theirs.get('class')} {theirs['arch']}, this one is "
                    f"{model.get('class')} {model['arch']}: parameter names/shapes differ)")
        # a store fingerprinted by the legacy scheme is compared by its writer (fingerprint_like)
        if weights_comparable(theirs, model) and theirs["weights"] != model["weights"]:
            return (f"it was collected with other model weights (fingerprint {theirs['weights']}, this model's is "
                    f"{model['weights']})")
    if projection is not False and stored.projection != projection:
        return (f"it was collected with projection {describe(stored.projection)}, this run asks for "
                f"{describe(projection)}")
    stored_loss = stored.convention.get("example_loss")
    if example_loss is not None and stored_loss and stored_loss != example_loss:
        return (f"its rows are gradients of the per-example {stored_loss!r} loss, this run takes those of the "
                f"{example_loss!r} loss (another loss convention)")
    if dtype is not None and stored.dtype != dtype:
        return f"it stores {stored.dtype}, this run asks for {dtype}"
    return None
