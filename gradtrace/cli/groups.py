"""Option groups shared by several commands (one dataclass per concern, one ``--help`` panel each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .options import Group, cli

__all__ = ["DataOptions", "ModelOptions", "ProjectionOptions"]


@dataclass(kw_only=True)
class ModelOptions(Group):
    """Where and in which precision the model runs."""

    panel = "Model"
    device: str = field(default="auto", metadata=cli(
        "Device to run the model on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."))
    model_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(default="float32", metadata=cli(
        "Precision the model is loaded in (auto: as saved); captured gradients are float32."))


@dataclass(kw_only=True)
class DataOptions(Group):
    """How a dataset file is read, tokenized and batched."""

    panel = "Data"
    text_field: str = field(default="text", metadata=cli("JSONL field holding each example's text."))
    id_field: str = field(default="id", metadata=cli(
        "JSONL field holding each example's id (optional; default ids are content hashes of the tokens)."))
    batch_size: int = field(default=8, metadata=cli("Examples per forward/backward pass.", min=1))
    max_length: int | None = field(default=None, metadata=cli(
        "Longest example in tokens (default: the model's context); longer ones are an error unless --truncate.",
        min=2))
    truncate: bool = field(default=False, metadata=cli(
        "Cut examples longer than --max-length instead of stopping with an error."))


@dataclass(kw_only=True)
class ProjectionOptions(Group):
    """LoGra random projection of the gradients at capture time."""

    panel = "Projection"
    projection: Literal["logra", "none"] = field(default="logra", metadata=cli(
        "logra: Kronecker-factored random projection at capture; none: exact full gradients (tiny models only)."))
    rank: int = field(default=16, metadata=cli(
        "LoGra rank per factor (a matrix parameter stores rank x rank numbers).", min=1))
    seed: int = field(default=0, metadata=cli("LoGra projection seed (queries are projected with the store's seed)."))
    ranks: str = field(default="", metadata=cli(
        "Per-parameter LoGra ranks, comma-separated GLOB=ROWSxCOLS or GLOB=RANK (e.g. '*wte.weight=512x32': keep "
        "an embedding's vocabulary axis).", metavar="SPEC"))

    def logra_ranks(self) -> dict[str, tuple[int, int]]:
        """``--ranks`` parsed into ``LoGra(ranks=...)``'s form."""
        out: dict[str, tuple[int, int]] = {}
        for part in filter(None, (p.strip() for p in self.ranks.split(","))):
            glob, sep, size = part.rpartition("=")
            rows, _, cols = size.partition("x")
            try:
                if not sep or not glob:
                    raise ValueError
                out[glob] = (int(rows), int(cols or rows))
            except ValueError:
                raise ValueError(f"--ranks: expected GLOB=ROWSxCOLS or GLOB=RANK, got {part!r}") from None
        return out
