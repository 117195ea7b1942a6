"""A local path for a name the user typed, and what the name's recipe says about running it.

`resolve` finds (or pulls) the file or directory; `run_defaults` reads the recipe's run
defaults for the variant this device gets; `alternatives` names smaller choices for the fit
check's refusal. The embedded default skips recipe parsing and the hardware probe: `atlas run`
with it reaches the first token sooner. The probe is the caller's: `resolve` and `run_defaults`
take its `hardware_class` rule and ask it only when a recipe's variant must be picked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_cli import recipes
from atlas_cli.errors import ModelNotFoundError
from atlas_cli.store import inventory
from atlas_cli.store.embedded import EMBEDDED
from atlas_cli.store.fetch import ensure_embedded
from atlas_cli.store.paths import existing_path
from atlas_cli.store.pull import HardwareClass, pull, recipe_variant


def resolve(
    name_or_path: str,
    progress=None,
    *,
    device: str | None = None,
    offline: bool | None = None,
    hardware_class: HardwareClass | None = None,
) -> Path:
    """A local file or directory for `name_or_path`, pulling the model when it is missing.

    `device` (cpu, cuda, hip; None: this machine's) picks a recipe's variant, through the
    caller's `hardware_class` (without one, the CPU's variant: see pull.recipe_variant).
    """
    candidate = existing_path(name_or_path)
    if candidate is not None:
        return candidate
    if name_or_path.lower() in EMBEDDED:  # the default: no recipe parsing, no hardware probe
        return ensure_embedded(EMBEDDED[name_or_path.lower()], progress=progress, offline=offline)
    ref = recipes.parse_ref(name_or_path)
    if ref.kind == "local":
        return ref.path
    variant = _chosen_variant(ref, device, hardware_class)
    for entry in inventory.installed():
        same = entry.name == ref.name and (variant is None or entry.variant == variant)
        if same and entry.complete:
            return entry.path
    return pull(
        name_or_path,
        device=device,
        offline=offline,
        progress=progress,
        hardware_class=hardware_class,
    ).path


def run_defaults(
    name_or_path: str, device: str | None = None, hardware_class: HardwareClass | None = None
) -> dict[str, Any]:
    """The recipe's run defaults (sampling, ctx_size, speculative, chat_template_kwargs, ...)
    for a model named by recipe, its variant picked as `resolve` picks it; {} for paths and
    Hub references."""
    if existing_path(name_or_path) is not None:
        return {}
    key = name_or_path.lower()
    if key in EMBEDDED:
        # the default's recipe has one variant: read its TOML directly (no schema import on the
        # path to the first token)
        import tomllib

        text = (recipes.RECIPE_DIR / f"{key}.toml").read_text(encoding="utf-8")
        return dict(tomllib.loads(text).get("defaults", {}))
    try:
        ref = recipes.parse_ref(name_or_path)
    except ModelNotFoundError:
        return {}
    if ref.kind != "recipe":
        return {}
    variant = _chosen_variant(ref, device, hardware_class)
    return ref.recipe.defaults_for(variant).model_dump(exclude_none=True)


def _chosen_variant(
    ref: recipes.ModelRef, device: str | None, hardware_class: HardwareClass | None
) -> str | None:
    if ref.kind == "recipe":
        return recipe_variant(ref, device, hardware_class)
    return ref.variant.lower() if ref.variant else None


def alternatives(path: Path, limit: int = 3) -> list[str]:
    """Smaller choices than the pulled model at `path`: its recipe's smaller variants, then
    smaller models of the same family (for the fit check's refusal)."""
    entry = next((e for e in inventory.installed() if e.path == path), None)
    recipe = recipes.get(entry.name) if entry is not None else None
    if recipe is None:
        return []
    current = recipe.variants[entry.variant].size if entry.variant in recipe.variants else None
    out = [
        f"{recipe.name}:{k}"
        for k, v in sorted(recipe.variants.items(), key=lambda kv: -(kv[1].size or 0))
        if current and v.size and v.size < current
    ]
    family = sorted(
        (
            r
            for r in recipes.all_recipes().values()
            if r.model.family == recipe.model.family
            and r.model.parameter_count < recipe.model.parameter_count
        ),
        key=lambda r: -r.model.parameter_count,
    )
    out += [r.name for r in family]
    return out[:limit]
