"""How atlas prints a size: decimal units (KB, MB, GB, as downloads and disks count them), one
decimal place under ten units. `atlas bench` alone keeps llama-bench's MiB/GiB column, so that
its table reads like the one it is compared with."""

from __future__ import annotations


def size_text(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
