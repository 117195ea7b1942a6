"""`atlas serve`: a model behind OpenAI's and Anthropic's HTTP APIs (atlas_cli/serve/)."""

from __future__ import annotations

from typing import Annotated

import typer

from atlas_cli.commands.options import CtxSize, Device, KvType, Model, ReasoningBudget, Threads
from atlas_cli.cpu_threads import use_threads
from atlas_cli.store.embedded import DEFAULT_MODEL

Host = Annotated[str, typer.Option(help="Address to listen on.")]
Port = Annotated[int, typer.Option(help="Port to listen on.")]
ServedModelName = Annotated[
    str | None, typer.Option(help="The model id clients send (default: MODEL).")
]
ApiKey = Annotated[
    str | None,
    typer.Option(envvar="ATLAS_API_KEY", help="Require this key (Bearer or x-api-key)."),
]
ChatTemplateKwargs = Annotated[
    str | None,
    typer.Option(help="Template defaults as JSON, e.g. '{\"enable_thinking\": false}'."),
]
ToolParser = Annotated[
    str | None,
    typer.Option(
        help="Tool-call format: hermes, qwen3_coder or none "
        "(default: the recipe's, else read from the chat template)."
    ),
]

CacheSize = Annotated[
    str | None,
    typer.Option(
        help="Prefix cache budget for all cached conversations, e.g. 8GiB, 512MiB, 0 "
        "(only the one in use); default: 8GiB, or a quarter of the free memory where less."
    ),
]
CacheDir = Annotated[
    str | None,
    typer.Option(
        help="Where conversations evicted from the prefix cache, and all of them at shutdown, "
        "are kept for the next server (default: the prefix folder in atlas's cache folder)."
    ),
]
CacheDisk = Annotated[
    str | None,
    typer.Option(
        help="Disk quota of --cache-dir, e.g. 8GiB, 0 (keep nothing on disk); default: 8GiB, "
        "or a quarter of the free disk where less."
    ),
]
SlotSavePath = Annotated[
    str | None,
    typer.Option(
        help="Folder where POST /slots/{id}?action=save|restore keep cached conversations "
        "(default: none, and both are refused)."
    ),
]
SlotSaveQuota = Annotated[
    str | None,
    typer.Option(
        help="Bytes all files in --slot-save-path may hold, e.g. 8GiB (the default: the "
        "default --cache-size); a save past it is refused."
    ),
]


def serve(
    model: Model = DEFAULT_MODEL,
    host: Host = "127.0.0.1",
    port: Port = 8080,
    served_model_name: ServedModelName = None,
    api_key: ApiKey = None,
    ctx_size: CtxSize = None,
    chat_template_kwargs: ChatTemplateKwargs = None,
    tool_parser: ToolParser = None,
    cache_size: CacheSize = None,
    cache_dir: CacheDir = None,
    cache_disk: CacheDisk = None,
    reasoning_budget: ReasoningBudget = None,
    slot_save_path: SlotSavePath = None,
    slot_save_quota: SlotSaveQuota = None,
    device: Device = None,
    kv_type: KvType = None,
    threads: Threads = None,
):
    """Serve a model over an OpenAI-compatible HTTP API (and Anthropic's /v1/messages)."""
    use_threads(threads)
    from atlas_cli.backend.sample import SamplingOverrides
    from atlas_cli.serve.server import parse_size, parse_template_kwargs
    from atlas_cli.serve.server import serve as run_server

    run_server(
        model,
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        ctx_size=ctx_size,
        device=device,
        kv_dtype=kv_type,
        template_kwargs=parse_template_kwargs(chat_template_kwargs),
        tool_parser=tool_parser,
        cache_bytes=parse_size(cache_size, "--cache-size"),
        cache_dir=cache_dir,
        cache_disk_bytes=parse_size(cache_disk, "--cache-disk"),
        sampling=SamplingOverrides(reasoning_budget=reasoning_budget),
        slot_save_path=slot_save_path,
        slot_save_quota=parse_size(slot_save_quota, "--slot-save-quota"),
    )
