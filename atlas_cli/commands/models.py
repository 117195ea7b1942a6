"""`atlas pull / list / show / rm / hw`: the model store and the hardware.

The work is in store/, describe.py, recipes/ and hardware.py; these commands call it and turn
the answers into text (or print them as JSON).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from atlas_cli.commands.options import (
    Json,
    Offline,
    VariantDevice,
    downloaded_argument,
    model_argument,
)
from atlas_cli.units import size_text

PullName = Annotated[str, model_argument("Recipe name, NAME:VARIANT, or hf.co/ORG/REPO[:QUANT].")]
ShowName = Annotated[str, model_argument("Recipe name, NAME:VARIANT, hf.co/... or a path.")]
RmName = Annotated[str, downloaded_argument("NAME (every variant) or NAME:VARIANT.")]
Revision = Annotated[
    str | None, typer.Option(help="Hub branch, tag or commit instead of the recipe's pin.")
]
Available = Annotated[
    bool, typer.Option("--available", help="List the recipes and the variant you would get.")
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
Verify = Annotated[
    bool,
    typer.Option(
        "--verify",
        help="Hash every installed file again (without it, only files whose size or mtime "
        "changed); damaged files are downloaded again.",
    ),
]
NoCompile = Annotated[
    bool,
    typer.Option(
        "--no-compile", help="Don't compile the GPU kernels; only say which backends can run."
    ),
]


def pull(
    name: PullName,
    revision: Revision = None,
    offline: Offline = False,
    device: VariantDevice = None,
    verify: Verify = False,
):
    """Download a model (resumable, verified) into the shared Hugging Face cache."""
    from atlas_cli.describe import memory_estimate
    from atlas_cli.hardware import hardware_class
    from atlas_cli.store.pull import pull as pull_model

    entry = pull_model(
        name,
        revision=revision,
        offline=offline or None,
        device=device,
        verify_all=verify,
        hardware_class=hardware_class,
    )
    checked = ", every file's hash checked" if verify else ""
    typer.echo(
        f"{entry.tag}: {size_text(entry.size)} {entry.format} {entry.quantization} "
        f"(from {entry.source}{checked}) at {entry.path}"
    )
    est = memory_estimate(entry.name, entry.variant, device)
    if est is not None:
        typer.echo(f"  memory: {memory_text(est.as_json())}")


def list_models(
    available: Available = False, json_output: Json = False, device: VariantDevice = None
):
    """List downloaded models (or, with --available, every recipe)."""
    if available:
        from atlas_cli.describe import available as available_recipes

        hw_class, rows = available_recipes(device)
        if json_output:
            typer.echo(json.dumps({"hardware_class": hw_class, "recipes": rows}, indent=1))
        else:
            typer.echo(available_text(hw_class, rows))
        return
    from atlas_cli.store.inventory import installed

    entries = installed()
    if json_output:
        typer.echo(json.dumps([e.as_json() for e in entries], indent=1))
    elif not entries:
        typer.echo("no models downloaded yet; try `atlas pull smollm2-135m`", err=True)
    else:
        typer.echo(installed_text(entries))


def show(name: ShowName, json_output: Json = False, device: VariantDevice = None):
    """Describe a model: architecture, parameters, quantization, context, licence, defaults."""
    from atlas_cli import recipes
    from atlas_cli.describe import describe

    info = describe(recipes.parse_ref(name), device)
    typer.echo(json.dumps(info, indent=1, default=str) if json_output else show_text(info))


def rm(name: RmName, yes: Yes = False):
    """Delete a downloaded model's files."""
    from atlas_cli import recipes
    from atlas_cli.errors import ModelNotFoundError, UsageError
    from atlas_cli.store import inventory

    if recipes.parse_ref(name).kind == "local":
        raise UsageError(f"{name} is a local path, not a pulled model; delete it yourself")
    entries = inventory.find_installed(name)
    if not entries:
        raise ModelNotFoundError(f"{name} is not downloaded (`atlas list` shows what is)")
    listing = ", ".join(f"{e.tag} ({size_text(e.size)})" for e in entries)
    if not yes and not typer.confirm(f"remove {listing}?", default=False):
        typer.echo("nothing removed", err=True)
        raise typer.Exit(1)
    from atlas_cli.keepalive import registry

    registry.stop_for_paths([e.path for e in entries])  # a kept-alive worker holds the file
    for entry in entries:
        freed = inventory.remove(entry)
        typer.echo(f"removed {entry.tag} ({size_text(freed)} freed)")


def hw(json_output: Json = False, device: VariantDevice = None, no_compile: NoCompile = False):
    """Show the detected devices, which backends can run and why not, and the variants.

    For each GPU backend that can run, compile its kernels and say per file how long it took.

    The first run compiles (a minute or so); later runs hit the cache. --no-compile skips it.
    """
    from atlas_cli.describe import hardware_report

    report = hardware_report(device, compile_kernels=not no_compile)
    typer.echo(json.dumps(report, indent=1) if json_output else hw_text(report))


# -- text --------------------------------------------------------------------------------------


def installed_text(entries) -> str:
    rows = [
        [
            e.name,
            e.variant,
            f"{e.format} {e.quantization}",
            size_text(e.size) if e.complete else "missing",
            ago(e.pulled),
        ]
        for e in entries
    ]
    return table(["NAME", "VARIANT", "FORMAT", "SIZE", "MODIFIED"], rows)


def available_text(hw_class: str, recipes: list[dict[str, Any]]) -> str:
    rows = [
        [
            o["name"],
            o["parameters"],
            o["variant"],
            f"{o['format']} {o['quantization']}",
            size_text(o["size"]) if o["size"] else "?",
            size_text(o["memory"]["total_bytes"])
            + (" (too big)" if o["memory"]["fits"] is False else ""),
            "yes" if o["installed"] else "",
            o["source"],
            o["description"],
        ]
        for o in recipes
    ]
    header = [
        "NAME",
        "PARAMS",
        "VARIANT",
        "FORMAT",
        "SIZE",
        "MEMORY",
        "PULLED",
        "FROM",
        "DESCRIPTION",
    ]
    return (
        table(header, rows)
        + f"\n(variants chosen for hardware class {hw_class}; NAME:VARIANT picks another)"
    )


_SHOW_FACTS = [
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


def show_text(info: dict[str, Any]) -> str:
    lines = []
    for key, label in _SHOW_FACTS:
        value = info.get(key)
        if value in (None, ""):
            continue
        if key == "parameter_count":
            value = f"{value:,}"
        lines.append(f"  {label + ':':18}{value}" if label else f"  {value}")
    if info.get("hardware_class"):
        gets = info.get("machine_variant") or info["variant"]
        here = (info.get("memory") or {}).get("fits") is not None
        label = "this machine:" if here else "on that device:"
        lines.append(f"  {label:18}{info['hardware_class']} gets {gets}")
    if info.get("defaults"):
        lines.append("  defaults:")
        for k, v in info["defaults"].items():
            if v not in ({}, None):
                lines.append(f"    {k + ':':22}{_value(v)}")
    if info.get("memory"):
        lines.append(f"  {'memory:':18}{memory_text(info['memory'])}")
        file_size = (info.get("variants") or {}).get(info["variant"], {}).get("size") or 0
        if info["memory"]["weights_bytes"] > 1.5 * file_size > 0:
            lines.append(f"  {'':18}(its {info['quantization']} weights are float32 on the CPU)")
    if info.get("variants"):
        lines.append("  variants:")
        lines += [variant_line(k, v, k == info.get("variant")) for k, v in info["variants"].items()]
    inst = info.get("installed")
    lines.append(f"  {'downloaded:':18}{inst['path'] if inst else 'no'}")
    return "\n".join(lines)


def memory_text(m: dict[str, Any]) -> str:
    """The fit estimate as one figure and the parts it sums."""
    parts = [f"{size_text(m['weights_bytes'])} weights", f"{size_text(m['kv_cache_bytes'])} KV "
             f"{m['kv_dtype']}"]  # fmt: skip
    if m.get("state_bytes"):
        parts.append(f"{size_text(m['state_bytes'])} linear-attention state")
    parts.append(f"{size_text(m['overhead_bytes'])} buffers")
    if m["fits"] is None:
        verdict = f"no {m['device']} device here to fit it in"
    else:
        verdict = "fits" if m["fits"] else "does NOT fit"
        verdict += f" in {size_text(m['available_bytes'])} ({m['device']})"
    return (
        f"{size_text(m['total_bytes'])} at {m['context']} tokens ({' + '.join(parts)}); {verdict}"
    )


def variant_line(key: str, v: dict[str, Any], chosen: bool) -> str:
    mark = "*" if chosen else " "
    state = "pulled" if v["installed"] else ""
    sz = size_text(v["size"]) if v["size"] else "?"
    return (
        f"   {mark}{key:10}{v['format']:12}{v['quantization']:8}{sz:>9}  "
        f"{v['repo']}@{v['revision'][:12]} {state}".rstrip()
    )


def _value(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_value(x)}" for k, x in v.items())
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def hw_text(report: dict[str, Any]) -> str:
    from atlas_cli import recipes

    cpu = report["cpu"]
    lines = [
        f"hardware class: {report['class']} (backend {report['backend']}: {report['reason']})",
        f"cpu:            {cpu['name']}, {cpu['cores']} cores, "
        f"{size_text(cpu['memory_bytes'])} RAM ({size_text(cpu['memory_available_bytes'])} "
        "available)",
    ]
    if not report["gpus"]:
        lines.append("gpus:           none found")
    for g in report["gpus"]:
        unified = ", unified memory" if g["unified_memory"] else ""
        lines.append(
            f"gpu:            {g['name']} ({g['arch']}, {size_text(g['memory_bytes'])}{unified}; "
            f"class {g['class'] or 'unsupported'}; via {g['source']})"
        )
    lines.append("backends:")
    for name, b in report["backends"].items():
        versions = ", ".join(f"{k} {b[k]}" for k in ("package", "driver", "runtime") if b.get(k))
        state = "yes" if b["available"] else f"no: {b['why_not']}"
        lines.append(f"  {name:6}{state}" + (f" [{versions}]" if versions else ""))
    for name, k in report["kernels"].items():
        lines.extend(kernel_lines(name, k))
    lines.append(f"variants for {report['class']}:")
    for rname, variant in report["recipes"].items():
        v = recipes.get(rname).variants[variant]
        lines.append(f"  {rname:16}{variant:10}{v.format} {v.quantization}")
    return "\n".join(lines)


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
    if gemm := k.get("gemm"):  # the prefill GEMM's first-use self-check (ops/native/gemm_check.py)
        lines.append(f"  prefill gemm ({gemm['kind']}): {gemm['kernel']} kernel, {gemm['reason']}")
    if verify := k.get("verify"):  # the verify GEMV's (MTP drafts: 2 to 8 tokens)
        lines.append(f"  verify gemv: {verify['kernel']} kernel, {verify['reason']}")
    if att := k.get("attention"):  # the prefill attention's (ops/native/attention_check.py)
        lines.append(f"  prefill attention: {att['kernel']} kernel, {att['reason']}")
    return lines


# -- formatting --------------------------------------------------------------------------------


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
