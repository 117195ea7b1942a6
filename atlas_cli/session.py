"""Open a model by name, once: the one road from a name to a loaded model.

`resolve` turns a name (recipe, NAME:VARIANT, Hub reference, embedded default, or path) into a
local path, picking the variant for the device and reading the recipe's run defaults into a
frozen `RunDefaults`; `load` checks the fit and hands the path to `backend.load`. `run`, `chat`,
`serve`, `bench` and the Python API all come this way, so a recipe's defaults reach every one
of them:

    from atlas_cli.session import open_model
    model = open_model("qwen3.6-27b", device="cuda")
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from atlas_cli.backend.defaults import RunDefaults


@dataclass(frozen=True)
class Resolved:
    """A name made local: where the model is and how its recipe says to run it."""

    name: str  # as the user wrote it
    path: Path
    device: str  # the variant was picked for this device, and the model loads on it
    defaults: RunDefaults = field(default_factory=RunDefaults)


def resolve(
    name: str, *, device: str | None = None, offline: bool | None = None, progress=None
) -> Resolved:
    """Find (or pull) `name` for `device` (None: `default_device()`); a one-line AtlasError for
    an unknown name, a failed download or a device that cannot be used (checked first: before
    any download)."""
    from atlas_cli import backend, hardware
    from atlas_cli.store import locate

    device = device or default_device()
    backend.open_device(device)
    path = locate.resolve(
        name,
        progress=progress,
        device=device,
        offline=offline,
        hardware_class=hardware.hardware_class,  # the store probes nothing itself
    )
    return Resolved(name, path, device, run_defaults(name, device=device))


def default_device() -> str:
    """The one rule for every command: ATLAS_DEVICE, else the GPU atlas can use here (the same
    detection `atlas pull` picks variants by), else cpu."""
    from atlas_cli import hardware

    return os.environ.get("ATLAS_DEVICE") or hardware.detect().device


def run_defaults(name: str, *, device: str = "cpu") -> RunDefaults:
    """The run defaults of the recipe variant `name` picks on `device` (none for a path or a
    Hub reference)."""
    from atlas_cli import hardware
    from atlas_cli.store import locate

    defaults = locate.run_defaults(name, device=device, hardware_class=hardware.hardware_class)
    return RunDefaults.from_recipe(defaults)


def load(
    resolved: Resolved,
    *,
    ctx_size: int | None = None,
    draft: int | None = None,
    kv_dtype: str | None = None,
):
    """Load a resolved model on its device, refusing it (ModelTooLargeError, with smaller
    choices) before its weights are materialized when it does not fit."""
    from atlas_cli import backend, fit
    from atlas_cli.store import locate

    path, device = resolved.path, resolved.device

    def fit_check(config, weights, context):
        suggest = lambda: locate.alternatives(path)  # noqa: E731  (asked only on a refusal)
        fit.check_loaded(path.name, config, weights, context, device, suggest, kv_dtype)

    model = backend.load(
        path,
        device=device,
        ops=backend.open_device(device),
        ctx_size=ctx_size,
        draft=draft,
        defaults=resolved.defaults,
        fit_check=fit_check,
        kv_dtype=kv_dtype,
    )
    name = recipe_name(resolved)
    if name is not None:  # a file's own name ("Smollm2 135M 8k Lc100K Mix1 Ep2") says less
        model.info = dataclasses.replace(model.info, name=name)
    return model


def recipe_name(resolved: Resolved) -> str | None:
    """The recipe a resolved model is a variant of: named as one, or a pulled file's path."""
    from atlas_cli import recipes
    from atlas_cli.errors import AtlasError
    from atlas_cli.store import inventory

    try:
        ref = recipes.parse_ref(resolved.name)
    except AtlasError:
        return None
    if ref.kind == "recipe":
        return ref.recipe.name
    for entry in inventory.installed():
        if entry.path.resolve() == resolved.path.resolve() and recipes.get(entry.name) is not None:
            return entry.name
    return None


def open_model(
    name: str,
    *,
    device: str | None = "cpu",
    ctx_size: int | None = None,
    draft: int | None = None,
    offline: bool | None = None,
    progress=None,
    kv_dtype: str | None = None,
):
    """`resolve` then `load`: the Python API's one call. The API runs on the CPU unless told;
    the commands pass the user's `--device` or None (`default_device()`). `kv_dtype`: the KV
    cache of a native device (bf16, fp8, f32; default the recipe's)."""
    from atlas_cli import backend

    backend.check_kv_type(kv_dtype)  # before anything is downloaded or loaded
    resolved = resolve(name, device=device, offline=offline, progress=progress)
    return load(resolved, ctx_size=ctx_size, draft=draft, kv_dtype=kv_dtype)
