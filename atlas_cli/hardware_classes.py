"""The recipe hardware classes and which class falls back to which: a leaf (no imports).

`hardware.classify` picks one of these classes for this machine; a recipe maps classes to its
variants (`recipes.schema.HardwareMap`). Both read the facts here, so the recipe schema needs
no hardware probe to be checked or to pick a variant for a class it is given.
"""

from __future__ import annotations

CLASSES = ("gb10", "strix_halo", "cuda", "amd", "cpu")


def fallback_chain(hw_class: str) -> tuple[str, ...]:
    """Which recipe keys to try, most specific first."""
    return {
        "gb10": ("gb10", "cuda", "cpu"),
        "strix_halo": ("strix_halo", "amd", "cpu"),
        "cuda": ("cuda", "cpu"),
        "amd": ("amd", "cpu"),
    }.get(hw_class, ("cpu",))
