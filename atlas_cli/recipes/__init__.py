"""Recipes: what a model name means. One TOML file per model in this folder.

A recipe names the model (family, architecture, size, licence, context), its variants (each a
Hub repo at a pinned revision, the files to fetch, format and quantization), which variant each
hardware class gets, and the run defaults (sampling, KV-cache dtype, speculative decoding,
tool-call parser, chat-template kwargs). Files are validated against the schema (schema.py) when
loaded; a bad file is a `RecipeError` naming the file and the field.

Names users type resolve through `parse_ref`:

    smollm2-135m                 recipe, variant picked for this machine's hardware
    qwen3-8b:q8_0                recipe and variant (variant key or quantization, any case)
    qwen3:8b                     an alias
    hf.co/org/repo[:Q4_K_M]      any Hub repo; the tag picks a GGUF quantization
    ./model.gguf, ./hf-model/    a local file or directory
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from atlas_cli.errors import ModelNotFoundError, RecipeError

if TYPE_CHECKING:
    from atlas_cli.recipes.schema import Recipe

# The schema's classes, imported on first use (see schema.py).
_SCHEMA_NAMES = {"Recipe", "Variant", "ModelFacts", "RunDefaults", "PyPISource", "HardwareMap"}


def __getattr__(name: str):
    if name in _SCHEMA_NAMES or name == "SCHEMA_VERSION":
        from atlas_cli.recipes import schema

        return getattr(schema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


RECIPE_DIR = Path(__file__).parent
HUB_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")

# -- loading -----------------------------------------------------------------------------------


def load_recipe(path: Path) -> Recipe:
    """Parse and validate one recipe file; errors name the file and the field."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path.name}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    from pydantic import ValidationError

    from atlas_cli.recipes.schema import Recipe

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{path.name}: {_describe(exc)}") from None
    if recipe.name != path.stem:
        raise RecipeError(f"{path.name}: name: {recipe.name!r} does not match the file name")
    return recipe


def _describe(exc) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def load_dir(directory: Path) -> dict[str, Recipe]:
    recipes: dict[str, Recipe] = {}
    taken: dict[str, str] = {}
    for path in sorted(directory.glob("*.toml")):
        recipe = load_recipe(path)
        for key in (recipe.name, *recipe.aliases):
            if key in taken:
                raise RecipeError(f"{path.name}: aliases: {key!r} is already used by {taken[key]}")
            taken[key] = path.name
        recipes[recipe.name] = recipe
    return recipes


@functools.cache
def all_recipes() -> dict[str, Recipe]:
    """The recipes shipped with atlas, by name."""
    return load_dir(RECIPE_DIR)


def get(name: str) -> Recipe | None:
    recipes = all_recipes()
    key = name.lower()
    if key in recipes:
        return recipes[key]
    for recipe in recipes.values():
        if key in recipe.aliases:
            return recipe
    return None


# -- names -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    """What a name the user typed refers to."""

    kind: Literal["recipe", "hub", "local"]
    text: str
    recipe: Recipe | None = None
    variant: str | None = None  # recipe: an explicit variant; hub: the quantization tag
    repo: str | None = None  # hub
    path: Path | None = None  # local

    @property
    def name(self) -> str:
        """The store's name for it: the recipe name, hf.co/org/repo, or the path."""
        if self.kind == "recipe":
            return self.recipe.name
        if self.kind == "hub":
            return f"hf.co/{self.repo}"
        return str(self.path)


def parse_ref(text: str) -> ModelRef:
    text = text.strip()
    if not text:
        raise ModelNotFoundError("empty model name")
    path = Path(text).expanduser()
    if path.exists():
        return ModelRef("local", text, path=path.resolve())
    for prefix in HUB_PREFIXES:
        if text.lower().startswith(prefix):
            return _hub_ref(text, text[len(prefix) :])
    recipe = get(text)
    if recipe is not None:
        return ModelRef("recipe", text, recipe=recipe)
    name, sep, tag = text.rpartition(":")
    if sep and name and (recipe := get(name)) is not None:
        variant = recipe.find_variant(tag)
        if variant is None:
            raise ModelNotFoundError(
                f"{recipe.name} has no variant {tag!r} (variants: {', '.join(recipe.variants)})"
            )
        return ModelRef("recipe", text, recipe=recipe, variant=variant)
    if os.sep in text or text.endswith((".gguf", ".safetensors")):
        raise ModelNotFoundError(f"{text}: no such file or directory")
    raise ModelNotFoundError(_unknown(text))


def _hub_ref(text: str, rest: str) -> ModelRef:
    repo, _, tag = rest.strip("/").partition(":")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo):
        raise ModelNotFoundError(f"{text}: expected hf.co/ORG/REPO or hf.co/ORG/REPO:QUANT")
    return ModelRef("hub", text, repo=repo, variant=tag or None)


def known_names() -> list[str]:
    names = []
    for recipe in all_recipes().values():
        names += [recipe.name, *recipe.aliases]
    return names


def _unknown(text: str) -> str:
    names = [r.name for r in all_recipes().values()]
    close = difflib.get_close_matches(text.lower(), known_names(), n=3, cutoff=0.5)
    # report recipe names, not aliases, in the suggestion
    close = list(dict.fromkeys(get(c).name for c in close))
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return (
        f"unknown model {text!r}{hint} (`atlas list --available` shows the {len(names)} "
        "recipes; also accepted: hf.co/ORG/REPO[:QUANT] or a path to a .gguf file or a "
        "Hugging Face model directory)"
    )


def is_model_name(text: str) -> bool:
    """True for a recipe name or alias, NAME:VARIANT, or an hf.co/ reference.

    Used by `atlas run` to tell a model name from a prompt, so it reads the TOML files without
    the schema (importing pydantic costs a few hundred milliseconds)."""
    key = text.lower()
    if key.startswith(HUB_PREFIXES):
        return True
    names = _name_index()
    if key in names:
        return True
    name, sep, tag = key.rpartition(":")
    return bool(sep) and name in names and tag in names[name][1]


def recipe_names() -> dict[str, str]:
    """name or alias (lowercase) -> the recipe's name, read without the schema."""
    return {key: name for key, (name, _) in _name_index().items()}


@functools.cache
def _name_index() -> dict[str, tuple[str, frozenset[str]]]:
    """name or alias -> the recipe's name and its variant keys and quantizations (lowercase)."""
    index: dict[str, tuple[str, frozenset[str]]] = {}
    for path in RECIPE_DIR.glob("*.toml"):
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            variants = data.get("variants", {})
            tags = frozenset(variants) | {
                str(v.get("quantization", "")).lower() for v in variants.values()
            }
            for name in [data["name"], *data.get("aliases", [])]:
                index[str(name).lower()] = (str(data["name"]), tags)
        except (OSError, tomllib.TOMLDecodeError, KeyError, AttributeError, TypeError):
            continue  # a broken recipe is reported when it is used
    return index


def as_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json", by_alias=True, exclude_none=True)
