"""Sizes in words: one formatter for every message and printed plan."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(count: int | float) -> str:
    """``count`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ..., ``"2048.0 TiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
