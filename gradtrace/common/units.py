"""Sizes: one formatter for every message and printed plan, and the default size of a streamed block of rows."""

from __future__ import annotations

__all__ = ["BLOCK_BYTES", "block_rows_for", "human_bytes"]

BLOCK_BYTES = 128 * 2**20
"""Float32 bytes of one streamed block of gradient rows by default: 8,192 rows of 4,096 dims, 305 of 109,696. Rows
per block follow from the dimension, so a store of long vectors never decodes gigabytes at once (memory bounded
by this, not by the store's rows)."""


def block_rows_for(dim: int, budget: int = BLOCK_BYTES, itemsize: int = 4) -> int:
    """Rows of ``dim`` values of ``itemsize`` bytes in a block of at most ``budget`` bytes (at least one row)."""
    return max(1, int(budget) // (itemsize * max(1, int(dim))))


def human_bytes(count: int | float) -> str:
    """``count`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ..., ``"2048.0 TiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
