"""How a model prefers to run: the run defaults its recipe names, as one frozen value.

`atlas_cli.session` reads them from the recipe once, when it resolves the name; the backend
applies them wherever the caller leaves a setting unset. A model opened by path has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from atlas_cli.backend.sample import SamplingOverrides


@dataclass(frozen=True)
class RunDefaults:
    sampling: SamplingOverrides = SamplingOverrides()
    ctx_size: int | None = None  # context when the caller gives none (capped by the model's)
    draft: int | None = None  # MTP tokens drafted per step; 0: off; None: the model's own
    kv_dtype: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_recipe(cls, values: Mapping[str, Any]) -> RunDefaults:
        """From a recipe's `[defaults]` table (merged with its variant's), as the schema dumps
        it: `speculative` is a table with `draft_tokens`, or false for "off"."""
        speculative = values.get("speculative")
        if speculative is False:
            draft = 0
        elif isinstance(speculative, Mapping):
            draft = speculative.get("draft_tokens")
        else:
            draft = None
        return cls(
            sampling=SamplingOverrides.from_mapping(values),
            ctx_size=values.get("ctx_size"),
            draft=draft,
            kv_dtype=values.get("kv_cache_dtype"),
            tool_call_parser=values.get("tool_call_parser"),
            reasoning_parser=values.get("reasoning_parser"),
            chat_template_kwargs=MappingProxyType(dict(values.get("chat_template_kwargs") or {})),
        )
