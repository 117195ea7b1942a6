"""`atlas-llama-server`: `atlas serve` behind llama-server's command line.

Tools that start llama.cpp's `llama-server` themselves (Lemonade's llama.cpp backend, with
LEMONADE_LLAMACPP_CPU_BIN and friends) can start atlas instead. `llama_args` reads the command
line as llama-server reads it, `plan` gives each flag atlas's meaning (the devices, the KV cache
type, the prefix cache, the slots folder, sampling and drafting defaults, the template's thinking
switch), and the server answers whatever model name a request carries, as llama-server does.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import AtlasError, UsageError
from atlas_cli.serve import llama_args
from atlas_cli.serve.llama_args import PROG

# llama.cpp's KV cache types (common/arg.cpp kv_cache_types)
LLAMA_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
KV_BITS = {"f32": 32, "bf16": 16, "f16": 16, "fp8": 8}
# llama.cpp's names of the GPUs atlas runs on, and the variable that picks each runtime's GPU
LLAMA_GPU = re.compile(r"(cuda|rocm|hip)(\d+)", re.IGNORECASE)
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "hip": "HIP_VISIBLE_DEVICES"}


@dataclass
class Launch:
    """What `main` does: `serve(model, **serve)` on `threads` CPU threads."""

    model: str
    serve: dict[str, Any]
    threads: int | None = None
    # flags atlas has no use for (or honours only in part: the why in brackets), as typed
    ignored: list[str] = field(default_factory=list)


def plan(
    argv: Sequence[str], environ: MutableMapping[str, str], default_device: Callable[[], str]
) -> Launch:
    """The server `argv` asks for. `environ` gets what the pull and the GPU runtime read
    (HF_TOKEN, HF_HUB_OFFLINE, CUDA_VISIBLE_DEVICES...) before `default_device` (atlas's
    choice when the command line makes none) is asked, since asking starts the runtime."""
    from atlas_cli.serve.server import parse_template_kwargs

    ns = llama_args.parse(argv)
    ignored = list(ns.ignored)
    model, name = model_to_serve(ns)
    if ns.hf_token:
        environ["HF_TOKEN"] = ns.hf_token
    if ns.offline:
        environ["HF_HUB_OFFLINE"] = "1"
    if "," in ns.host or ns.host.endswith(".sock"):
        raise UsageError(f"--host {ns.host}: atlas listens on one TCP address")
    device = choose_device(ns, environ, ignored)
    kv = kv_type(ns.cache_type_k, ns.cache_type_v, lambda: device or default_device(), ignored)
    if ns.gpu_layers is not None and ns.gpu_layers.strip() != "0":
        ignored.append(f"-ngl {ns.gpu_layers} (atlas keeps the whole model on its device)")
    if ns.reasoning_format not in (None, "auto", "deepseek"):
        ignored.append(
            f"--reasoning-format {ns.reasoning_format} (atlas puts it in reasoning_content)"
        )
    thinking = thinking_switch(ns, ignored)
    template_kwargs = {**thinking, **(parse_template_kwargs(ns.chat_template_kwargs) or {})}
    serve = {
        "host": ns.host,
        "port": ns.port,
        "served_model_name": ns.alias.split(",")[0] if ns.alias else name,
        "api_key": api_key(ns.api_key, ns.api_key_file),
        "ctx_size": ns.ctx_size or None,  # llama-server's 0: the model's own
        "device": device,
        "kv_dtype": kv,
        "log_level": "debug" if ns.verbose else "warning" if ns.log_disable else "info",
        "accept_any_model": True,
        "template_kwargs": template_kwargs or None,
        "cache_bytes": cache_bytes(ns.cache_ram, ignored),
        "slot_save_path": ns.slot_save_path or None,
        "sampling": sampling_defaults(ns),
        "draft": draft_tokens(ns.spec_type, ns.draft, ignored),
    }
    threads = ns.threads if ns.threads is not None and ns.threads > 0 else None  # -1: all
    return Launch(model, serve, threads, ignored)


def model_to_serve(ns) -> tuple[str, str | None]:
    """The model atlas opens (a path, or an hf.co/ reference atlas pulls) and the name it
    goes by (None: the file's)."""
    if ns.model and ns.hf_repo:
        raise UsageError("give -m PATH or -hf ORG/REPO[:QUANT], not both")
    if ns.hf_repo:
        repo = re.sub(r"^(https?://)?(huggingface\.co|hf\.co)/", "", ns.hf_repo)
        return f"hf.co/{repo}", repo
    if ns.model:
        return ns.model, None
    raise UsageError("no model: give -m PATH or -hf ORG/REPO[:QUANT] (there is no router mode)")


def choose_device(ns, environ: MutableMapping[str, str], ignored: list[str]) -> str | None:
    """atlas's device for --device, -mg and -ngl 0 (None: atlas's own choice). atlas runs on
    its runtime's first GPU, so a later one is made the first through the runtime's
    *_VISIBLE_DEVICES, which llama.cpp's device numbers count in too."""
    if ns.gpu_layers is not None and ns.gpu_layers.strip() == "0":
        return "cpu"  # no layer on a GPU
    if ns.device is None:
        if ns.main_gpu:  # the n-th GPU of whichever runtime atlas picks
            for variable in VISIBLE_DEVICES.values():
                make_first(environ, variable, ns.main_gpu)
        return None
    names = [n.strip() for n in ns.device.split(",") if n.strip()]
    index = ns.main_gpu or 0
    if not names or index >= len(names):
        raise UsageError(f"-mg {index}: --device {ns.device} names {len(names)} device(s)")
    if len(names) > 1:
        ignored.append(f"--device {ns.device} (atlas runs on one: {names[index]})")
    name = names[index]
    if name.lower() in ("none", "cpu"):
        return "cpu"
    gpu = LLAMA_GPU.fullmatch(name)
    if gpu is None:
        raise UsageError(f"--device {name}: atlas runs on none (the CPU), CUDA0... or ROCm0...")
    device = "cuda" if gpu[1].lower() == "cuda" else "hip"
    make_first(environ, VISIBLE_DEVICES[device], int(gpu[2]))
    return device


def make_first(environ: MutableMapping[str, str], variable: str, index: int) -> None:
    """Show the runtime only its `index`-th visible GPU."""
    if index == 0:
        return
    visible = [v.strip() for v in environ[variable].split(",")] if environ.get(variable) else None
    if visible is None:
        environ[variable] = str(index)
    elif index < len(visible):
        environ[variable] = visible[index]
    else:
        raise UsageError(f"GPU {index}: {variable}={environ[variable]} shows {len(visible)}")


def kv_type(
    k: str | None, v: str | None, device: Callable[[], str], ignored: list[str]
) -> str | None:
    """atlas's --kv-type for llama.cpp's -ctk/-ctv: the same width where `device` has it, fp8
    for the quantized types on a GPU; one type for K and V (the wider of the two)."""
    given = [(flag, t) for flag, t in (("-ctk", k), ("-ctv", v)) if t is not None]
    for flag, t in given:
        if t not in LLAMA_KV_TYPES:
            raise UsageError(f"{flag} {t}: llama-server's KV types are {', '.join(LLAMA_KV_TYPES)}")
    if not given:
        return None
    name = device()
    allowed = device_kv_types(name)
    mapped = [(flag, t, nearest_kv_type(t, allowed)) for flag, t in given]
    usable = [atlas for _, _, atlas in mapped if atlas is not None]
    chosen = max(usable, key=KV_BITS.__getitem__) if usable else None
    for flag, t, atlas in mapped:
        if atlas is None:
            why = f"{name} keeps its KV cache in {' or '.join(allowed)}"
        elif atlas != chosen:
            why = "atlas has one type for K and V"
        elif atlas != t:
            why = f"the nearest on {name}"
        else:
            continue
        ignored.append(f"{flag} {t} ({chosen} instead: {why})" if chosen else f"{flag} {t} ({why})")
    return chosen


def nearest_kv_type(llama_type: str, allowed: Sequence[str]) -> str | None:
    if llama_type == "f32":
        wanted = ["f32"]
    elif llama_type in ("f16", "bf16"):
        wanted = [llama_type, "bf16", "f16"]
    else:  # q8_0 and the 4- and 5-bit types: atlas's 8-bit type is its smallest
        wanted = ["fp8"]
    return next((t for t in wanted if t in allowed), None)


def device_kv_types(device: str) -> tuple[str, ...]:
    """The --kv-type values `device`'s caches take (the ops' KV_TYPES, without loading them)."""
    from atlas_cli.backend import NATIVE_DEVICES

    if device in NATIVE_DEVICES:
        from atlas_cli.backend.ops.native.attention import KV_DTYPES

        return tuple(KV_DTYPES)
    if device == "cpu-ref":
        return ("f32",)  # the float32 reference
    from atlas_cli.backend.cache import HOST_KV_TYPES

    return tuple(HOST_KV_TYPES)


def thinking_switch(ns, ignored: list[str]) -> dict[str, bool]:
    """llama.cpp's --reasoning-budget 0 and -rea off/on, as the templates' enable_thinking
    (a budget itself is a sampling default: `sampling_defaults`)."""
    if ns.reasoning_budget == 0 or ns.reasoning == "off":
        return {"enable_thinking": False}
    if ns.reasoning == "on":
        return {"enable_thinking": True}
    return {}


def api_key(given: str | None, key_file: str | None) -> str | None:
    """llama.cpp takes several keys (comma-separated, or one per line of a file); atlas one."""
    keys = given.split(",") if given else []
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UsageError(f"--api-key-file {key_file}: {exc.strerror}") from None
        keys += [line for line in lines if not line.lstrip().startswith("#")]
    keys = list(dict.fromkeys(k.strip() for k in keys if k.strip()))
    if len(keys) > 1:
        raise UsageError(f"atlas takes one API key, not {len(keys)}")
    return keys[0] if keys else None


def cache_bytes(mib: int | None, ignored: list[str]) -> int | None:
    """--cache-ram MiB as atlas's prefix cache budget (0: only the conversation in use)."""
    if mib is None:
        return None
    if mib < 0:
        ignored.append(f"--cache-ram {mib} (atlas's prefix cache keeps its default budget)")
        return None
    return mib << 20


def sampling_defaults(ns) -> SamplingOverrides | None:
    """The command line's sampling, under each request's own and over the recipe's."""
    given = {
        "temperature": ns.temperature,
        "top_k": ns.top_k,
        "top_p": ns.top_p,
        "min_p": ns.min_p,
        "repeat_penalty": ns.repeat_penalty,
        "presence_penalty": ns.presence_penalty,
        "seed": ns.seed if ns.seed is not None and ns.seed >= 0 else None,  # -1: random
        # tokens of thought before `</think>` is forced; -1: no limit
        "reasoning_budget": ns.reasoning_budget if (ns.reasoning_budget or 0) >= 0 else None,
    }
    if all(v is None for v in given.values()):
        return None
    return SamplingOverrides(**given)


def draft_tokens(spec_type: str | None, draft: int | None, ignored: list[str]) -> int | None:
    """Tokens drafted per step by the model's MTP head: 0 for --spec-type none; None leaves
    the model's own."""
    kinds = {k.strip() for k in spec_type.split(",")} if spec_type else set()
    if kinds == {"none"}:
        return 0
    if kinds - {"none", "draft-mtp"}:
        ignored.append(f"--spec-type {spec_type} (atlas drafts with the model's MTP head only)")
    return draft


def main(argv: list[str] | None = None) -> None:
    from atlas_cli.cpu_threads import use_threads
    from atlas_cli.serve.server import serve
    from atlas_cli.session import default_device

    try:
        launch = plan(sys.argv[1:] if argv is None else argv, os.environ, default_device)
        if launch.ignored:
            print(f"{PROG}: ignoring {', '.join(launch.ignored)}", file=sys.stderr)
        use_threads(launch.threads)
        serve(launch.model, **launch.serve)
    except AtlasError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
