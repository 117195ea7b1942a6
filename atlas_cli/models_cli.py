"""`atlas pull / list / show / rm / hw`: the model store and hardware commands.

Registered on the app by cli.py. Commands parse and print; the work is in store/, recipes/ and
hardware.py. Nothing heavy is imported at module level (`atlas --help`).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help="Pick variants for cpu, cuda or hip (default: detected, ATLAS_DEVICE)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def register(app: typer.Typer, handle_errors) -> None:
    app.command("pull")(handle_errors(pull))
    app.command("list")(handle_errors(list_models))
    app.command("show")(handle_errors(show))
    app.command("rm")(handle_errors(rm))
    app.command("hw")(handle_errors(hw))


# -- pull --------------------------------------------------------------------------------------


def pull(
    name: Annotated[
        str, typer.Argument(help="Recipe name, NAME:VARIANT, or hf.co/ORG/REPO[:QUANT].")
    ],
    revision: Annotated[
        str | None, typer.Option(help="Hub branch, tag or commit instead of the recipe's pin.")
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Use only the local caches (also HF_HUB_OFFLINE=1).")
    ] = False,
    device: DeviceOpt = None,
):
    """Download a model (resumable, verified) into the shared Hugging Face cache."""
    from atlas_cli.store.pull import pull as pull_model

    entry = pull_model(name, revision=revision, offline=offline or None, device=device)
    typer.echo(
        f"{entry.tag}: {size(entry.size)} {entry.format} {entry.quantization} "
        f"(from {entry.source}) at {entry.path}"
    )


# -- list --------------------------------------------------------------------------------------


def list_models(
    available: Annotated[
        bool, typer.Option("--available", help="List the recipes and the variant you would get.")
    ] = False,
    json_output: JsonOpt = False,
    device: DeviceOpt = None,
):
    """List downloaded models (or, with --available, every recipe)."""
    from atlas_cli.store.inventory import installed

    if available:
        return _list_available(json_output, device)
    entries = installed()
    if json_output:
        typer.echo(json.dumps([e.as_json() for e in entries], indent=1))
        return
    if not entries:
        typer.echo("no models downloaded yet; try `atlas pull smollm2-135m`", err=True)
        return
    rows = [
        [
            e.name,
            e.variant,
            f"{e.format} {e.quantization}",
            size(e.size) if e.complete else "missing",
            ago(e.pulled),
        ]
        for e in entries
    ]
    typer.echo(table(["NAME", "VARIANT", "FORMAT", "SIZE", "MODIFIED"], rows))


def _list_available(json_output: bool, device: str | None) -> None:
    from atlas_cli import hardware, recipes
    from atlas_cli.store.inventory import installed

    hw_class = hardware.hardware_class(device)
    have = {(e.name, e.variant) for e in installed() if e.complete}
    out = []
    for r in recipes.all_recipes().values():
        variant = r.variant_for(hw_class)
        v = r.variants[variant]
        out.append(
            {
                "name": r.name,
                "parameters": r.model.parameters,
                "variant": variant,
                "format": v.format,
                "quantization": v.quantization,
                "size": v.size,
                "installed": (r.name, variant) in have,
                "variants": list(r.variants),
                "description": r.description,
            }
        )
    if json_output:
        typer.echo(json.dumps({"hardware_class": hw_class, "recipes": out}, indent=1))
        return
    rows = [
        [
            o["name"],
            o["parameters"],
            o["variant"],
            f"{o['format']} {o['quantization']}",
            size(o["size"]) if o["size"] else "?",
            "yes" if o["installed"] else "",
            o["description"],
        ]
        for o in out
    ]
    typer.echo(
        table(["NAME", "PARAMS", "VARIANT", "FORMAT", "SIZE", "PULLED", "DESCRIPTION"], rows)
    )
    typer.echo(f"(variants chosen for hardware class {hw_class}; NAME:VARIANT picks another)")


# -- show --------------------------------------------------------------------------------------


def show(
    name: Annotated[str, typer.Argument(help="Recipe name, NAME:VARIANT, hf.co/... or a path.")],
    json_output: JsonOpt = False,
    device: DeviceOpt = None,
):
    """Describe a model: architecture, parameters, quantization, context, licence, defaults."""
    from atlas_cli import recipes

    ref = recipes.parse_ref(name)
    info = _show_recipe(ref, device) if ref.kind == "recipe" else _show_file(ref)
    if json_output:
        typer.echo(json.dumps(info, indent=1, default=str))
        return
    typer.echo(_render(info))


def _show_recipe(ref, device: str | None) -> dict[str, Any]:
    from atlas_cli import fit, hardware, recipes
    from atlas_cli.store.inventory import installed as installed_models

    r = ref.recipe
    chosen = hardware.detect(device) if device not in ("cpu", "cpu-ref") else None
    hw_class = chosen.hw_class if chosen else "cpu"
    variant = ref.variant or r.variant_for(hw_class)
    v = r.variants[variant]
    defaults = r.defaults_for(variant)
    installed = {e.variant: e for e in installed_models() if e.name == r.name}
    ctx = defaults.ctx_size or r.model.context_length
    shape = fit.KVShape(r.model.kv_layers, r.model.kv_heads, r.model.head_dim, r.model.state_bytes)
    if hw_class == "cpu":
        weights = r.model.parameter_count * fit.CPU_WEIGHT_BYTES
        kv_dtype, memory = "f32", hardware.system_memory()[1]
    else:
        weights = v.size or r.model.parameter_count * 2
        kv_dtype = defaults.kv_cache_dtype if defaults.kv_cache_dtype in fit.DTYPE_BYTES else "bf16"
        memory = chosen.memory_bytes
    est = fit.estimate(weights, shape, ctx, kv_dtype, memory, hw_class)
    return {
        "name": r.name,
        "description": r.description,
        "variant": variant,
        "hardware_class": hw_class,
        "architecture": r.model.architecture,
        "family": r.model.family,
        "parameters": r.model.parameters,
        "parameter_count": r.model.parameter_count,
        "format": v.format,
        "quantization": v.quantization,
        "context_length": r.model.context_length,
        "license": r.model.license,
        "template": r.model.template,
        "source": f"{v.repo}@{v.revision}"
        + (f" (PyPI {v.pypi.package} {v.pypi.version})" if v.pypi else ""),
        "defaults": defaults.model_dump(exclude_none=True),
        "memory": est.as_json(),
        "installed": installed[variant].as_json() if variant in installed else None,
        "variants": {
            k: {
                "format": x.format,
                "quantization": x.quantization,
                "repo": x.repo,
                "revision": x.revision,
                "size": x.size,
                "installed": k in installed,
                "note": x.note or None,
            }
            for k, x in r.variants.items()
        },
        "aliases": r.aliases,
        "recipe": recipes.as_dict(r),
    }


def _show_file(ref) -> dict[str, Any]:
    from atlas_cli.errors import ModelNotFoundError
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
    from atlas_cli.errors import AtlasError

    if path.is_dir():
        config_path = path / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise AtlasError(f"{config_path}: cannot read ({exc})") from None
        text = config.get("text_config") or config
        quant = (config.get("quantization_config") or {}).get("quant_algo") or str(
            text.get("torch_dtype") or text.get("dtype") or "?"
        )
        size_ = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return {
            "path": str(path),
            "format": "safetensors",
            "architecture": config.get("model_type"),
            "quantization": quant,
            "context_length": text.get("max_position_embeddings"),
            "layers": text.get("num_hidden_layers"),
            "size": size_,
            "template": "chat_template.jinja"
            if (path / "chat_template.jinja").exists()
            else "tokenizer_config.json",
        }
    from atlas_cli.backend.loaders import gguf
    from atlas_cli.store.paths import cache_dir

    gf = gguf.open_gguf(path, cache_dir=cache_dir())
    md = gf.metadata
    arch = md.get("general.architecture")
    counts: dict[int, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) == 2:
            counts[t.type_id] = counts.get(t.type_id, 0) + 1
    from atlas_cli.backend.loaders import quant

    main = max(counts, key=counts.get) if counts else None
    template = md.get("tokenizer.chat_template")
    return {
        "path": str(path),
        "format": "gguf",
        "name_in_file": md.get("general.name"),
        "architecture": arch,
        "quantization": quant.GGML_TYPES[main].name if main in quant.GGML_TYPES else "?",
        "parameter_count": sum(_prod(t.shape) for t in gf.tensors.values()),
        "context_length": md.get(f"{arch}.context_length"),
        "layers": md.get(f"{arch}.block_count"),
        "size": path.stat().st_size,
        "template": (template.splitlines()[0][:60] + "…") if template else None,
        "license": md.get("general.license"),
    }


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _render(info: dict[str, Any]) -> str:
    lines = []
    keys = [
        ("name", "model"),
        ("description", ""),
        ("architecture", "architecture"),
        ("parameters", "parameters"),
        ("parameter_count", "parameter count"),
        ("variant", "variant"),
        ("format", "format"),
        ("quantization", "quantization"),
        ("context_length", "context length"),
        ("license", "licence"),
        ("template", "template"),
        ("source", "source"),
        ("path", "path"),
    ]
    for key, label in keys:
        value = info.get(key)
        if value in (None, ""):
            continue
        if key == "parameter_count":
            value = f"{value:,}"
        lines.append(f"  {label + ':':18}{value}" if label else f"  {value}")
    if info.get("hardware_class"):
        lines.append(f"  {'this machine:':18}{info['hardware_class']} gets {info['variant']}")
    if info.get("defaults"):
        lines.append("  defaults:")
        for k, v in info["defaults"].items():
            if v not in ({}, None):
                lines.append(f"    {k + ':':22}{_fmt(v)}")
    if info.get("memory"):
        m = info["memory"]
        verdict = "fits" if m["fits"] else "does NOT fit"
        lines.append(
            f"  {'memory:':18}{size(m['total_bytes'])} at {m['context']} tokens "
            f"({size(m['weights_bytes'])} weights + {size(m['kv_cache_bytes'])} "
            f"KV {m['kv_dtype']}); "
            f"{verdict} in {size(m['available_bytes'])} ({m['device']})"
        )
    if info.get("variants"):
        lines.append("  variants:")
        for k, v in info["variants"].items():
            mark = "*" if k == info.get("variant") else " "
            state = "pulled" if v["installed"] else ""
            sz = size(v["size"]) if v["size"] else "?"
            lines.append(
                f"   {mark}{k:10}{v['format']:12}{v['quantization']:8}{sz:>9}  "
                f"{v['repo']}@{v['revision'][:12]} {state}".rstrip()
            )
    inst = info.get("installed")
    lines.append(f"  {'downloaded:':18}{inst['path'] if inst else 'no'}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# -- rm ----------------------------------------------------------------------------------------


def rm(
    name: Annotated[str, typer.Argument(help="NAME (every variant) or NAME:VARIANT.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
):
    """Delete a downloaded model's files."""
    from atlas_cli import recipes
    from atlas_cli.errors import ModelNotFoundError, UsageError
    from atlas_cli.store import inventory

    ref = recipes.parse_ref(name)
    if ref.kind == "local":
        raise UsageError(f"{name} is a local path, not a pulled model; delete it yourself")
    entries = inventory.find_installed(name)
    if not entries:
        raise ModelNotFoundError(f"{name} is not downloaded (`atlas list` shows what is)")
    listing = ", ".join(f"{e.tag} ({size(e.size)})" for e in entries)
    if not yes and not typer.confirm(f"remove {listing}?", default=False):
        typer.echo("nothing removed", err=True)
        raise typer.Exit(1)
    for entry in entries:
        freed = inventory.remove(entry)
        typer.echo(f"removed {entry.tag} ({size(freed)} freed)")


# -- hw ----------------------------------------------------------------------------------------


def hw(
    json_output: JsonOpt = False,
    device: DeviceOpt = None,
    no_compile: Annotated[
        bool,
        typer.Option(
            "--no-compile", help="Don't compile the GPU kernels; only say which backends can run."
        ),
    ] = False,
):
    """Show the detected devices, which backends can run and why not, and the variants.

    For each GPU backend that can run, compile its kernels and say per file how long it took.

    The first run compiles (a minute or so); later runs hit the cache. --no-compile skips it.
    """
    import os

    from atlas_cli import hardware, recipes

    probe = hardware.probe()
    override = device or os.environ.get("ATLAS_DEVICE") or None
    chosen = hardware.classify(probe, override)
    report = hardware.report(probe, chosen)
    report["recipes"] = {
        r.name: r.variant_for(chosen.hw_class) for r in recipes.all_recipes().values()
    }
    report["kernels"] = hardware.kernel_reports(compile_kernels=not no_compile)
    if json_output:
        typer.echo(json.dumps(report, indent=1))
        return
    cpu = report["cpu"]
    lines = [
        f"hardware class: {chosen.hw_class} (backend {chosen.backend}: {chosen.reason})",
        f"cpu:            {cpu['name']}, {cpu['cores']} cores, {size(cpu['memory_bytes'])} RAM "
        f"({size(cpu['memory_available_bytes'])} available)",
    ]
    if not probe.gpus:
        lines.append("gpus:           none found")
    for g in report["gpus"]:
        unified = ", unified memory" if g["unified_memory"] else ""
        lines.append(
            f"gpu:            {g['name']} ({g['arch']}, {size(g['memory_bytes'])}{unified}; "
            f"class {g['class'] or 'unsupported'}; via {g['source']})"
        )
    lines.append("backends:")
    for name, b in report["backends"].items():
        versions = ", ".join(f"{k} {b[k]}" for k in ("package", "driver", "runtime") if b.get(k))
        state = "yes" if b["available"] else f"no: {b['why_not']}"
        lines.append(f"  {name:6}{state}" + (f" [{versions}]" if versions else ""))
    for name, k in report["kernels"].items():
        lines.extend(kernel_lines(name, k))
    lines.append(f"variants for {chosen.hw_class}:")
    for rname, variant in report["recipes"].items():
        v = recipes.get(rname).variants[variant]
        lines.append(f"  {rname:16}{variant:10}{v.format} {v.quantization}")
    typer.echo("\n".join(lines))


def kernel_lines(backend: str, k: dict[str, Any]) -> list[str]:
    """One backend's kernel report (hardware.kernel_reports) as `atlas hw` lines."""
    if "skipped" in k:
        return [f"kernels {backend}: not compiled ({k['skipped']})"]
    if "error" in k:
        return [f"kernels {backend}: failed: {k['error']}"]
    about = ", ".join(str(k[x]) for x in ("target", "device", "toolchain") if k.get(x))
    lines = [f"kernels {backend} ({about}):"]
    for file, e in k["kernels"].items():
        state = "cache hit" if e["cache_hit"] else f"compiled in {e['seconds']:.2f} s"
        lines.append(f"  {file:16}{state}")
    lines.append(
        f"  {len(k['kernels'])} files: {k['compiled']} compiled in {k['compile_s']:.2f} s, "
        f"{k['cache_hits']} from the cache"
    )
    return lines


# -- formatting --------------------------------------------------------------------------------


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def ago(iso: str) -> str:
    try:
        then = datetime.fromisoformat(iso)
    except ValueError:
        return "?"
    seconds = (datetime.now(UTC) - then).total_seconds()
    for unit, span in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= span:
            n = int(seconds // span)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])
