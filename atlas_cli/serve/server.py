"""`atlas serve`: bind, then run the app under uvicorn. The port is bound before the model
loads, so a taken port fails at once; the weights load while /health answers 503."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import AtlasError, UsageError
from atlas_cli.serve.app import ServeConfig, create_app
from atlas_cli.serve.browser_guard import LOOPBACK_NAMES
from atlas_cli.serve.slot_files import DEFAULT_QUOTA, slot_folder

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

# Limits on what a client may hold. uvicorn has settings for idle keep-alive, connection count
# and header size, but none for how long a request's headers may take: TimedH11Protocol adds it
# (connection_limits adds a client's share of the connections and the size of whole headers).
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5
MAX_CONNECTIONS = 128  # beyond this a new request gets a 503 at once
MAX_HEADER_BYTES = 32 * 1024


def timed_protocol(header_timeout: float):
    """uvicorn's h11 protocol (with connection_limits') and a deadline for each request's
    headers: a client sending a byte at a time (slowloris) is closed when it passes, instead of
    holding a connection."""
    import h11

    from atlas_cli.serve.connection_limits import LimitedH11Protocol

    class TimedH11Protocol(LimitedH11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's headers start arriving
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()  # the headers are in: the body has its own limit
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._too_slow)

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE:
                self.timeout_keep_alive_handler()  # uvicorn's own way to close an idle one

    return TimedH11Protocol


def uvicorn_config(app, *, log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_S):
    """The uvicorn settings `atlas serve` runs with (tests start their servers with them)."""
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=3,
        http=timed_protocol(header_timeout),
        timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=MAX_CONNECTIONS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port"
        ) from None
    sock.listen(128)
    return sock


def show_server_log() -> None:
    """Print atlas's own server log ("ready", a failed load) on stderr, as uvicorn prints
    its own: the logger has no handler otherwise, and its info lines would be lost."""
    log = logging.getLogger("atlas.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def parse_template_kwargs(text: str | None) -> dict | None:
    """`--chat-template-kwargs '{"enable_thinking": false}'`"""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--chat-template-kwargs is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError("--chat-template-kwargs must be a JSON object")
    return value


def parse_size(text: str | None, flag: str) -> int | None:
    """`8GiB`, `512M`, `1.5g`, `0`: bytes (K, M, G, T and KiB... are powers of 1024)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise UsageError(f"{flag} must be a size such as 8GiB, 512MiB or 0, got {text!r}")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


def recipe_tool_parser(model: str, device: str) -> str | None:
    """The tool-call parser a recipe names for the variant `model` resolves to (None for a
    path, a hub name, or a parser atlas does not have: the chat template decides then)."""
    from atlas_cli import session

    try:
        defaults = session.run_defaults(model, device=device)
    except AtlasError:
        return None
    return known_parser(defaults.tool_call_parser)


def known_parser(name: str | None) -> str | None:
    from atlas_cli.serve.toolcalls import PARSERS

    return name if name in PARSERS else None


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    served_model_name: str | None = None,
    api_key: str | None = None,
    ctx_size: int | None = None,
    device: str | None = None,
    kv_dtype: str | None = None,
    log_level: str = "info",
    accept_any_model: bool = False,
    template_kwargs: dict | None = None,
    tool_parser: str | None = None,
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    cache_disk_bytes: int | None = None,
    sampling: SamplingOverrides | None = None,
    draft: int | None = None,
    slot_save_path: str | None = None,
    slot_save_quota: int | None = None,
) -> None:
    """`cache_dir` None: the prefix folder of atlas's cache folder; `cache_disk_bytes` None:
    its default quota, 0: keep nothing on disk. `sampling` and `draft` (MTP tokens per step;
    0: off) go over the recipe's defaults; each request's own sampling still comes first."""
    import uvicorn

    from atlas_cli import backend, session
    from atlas_cli.backend.prefix_disk import disk_place

    backend.check_kv_type(kv_dtype)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port}")
    if ctx_size is not None and ctx_size < 16:
        raise UsageError(f"--ctx-size must be at least 16, got {ctx_size}")
    if tool_parser is not None:
        from atlas_cli.serve.toolcalls import select_parser

        select_parser(None, tool_parser)  # an unknown name fails here
    # resolved once, here: a bad name fails before the server starts, and the recipe's run
    # defaults (sampling, context, template kwargs, tool-call parser) travel to the loader
    resolved = session.resolve(model, device=device)
    resolved = with_defaults(resolved, sampling, draft)
    if tool_parser in (None, "", "auto"):
        tool_parser = known_parser(resolved.defaults.tool_call_parser)
    name = served_model_name or (Path(model).stem if model.endswith(".gguf") else model)
    config = ServeConfig(
        model=str(resolved.path),
        served_model_name=name,
        api_key=api_key,
        ctx_size=ctx_size,
        device=resolved.device,
        kv_dtype=kv_dtype,
        accept_any_model=accept_any_model,
        template_kwargs=template_kwargs,
        tool_parser=tool_parser,
        cache_bytes=cache_bytes,
        resolved=resolved,
        host=host,
        slot_save_path=slot_folder(slot_save_path) if slot_save_path else None,
        slot_save_quota=DEFAULT_QUOTA if slot_save_quota is None else slot_save_quota,
    )
    folder, quota = disk_place(cache_dir, cache_disk_bytes)
    if quota > 0:
        config = dataclasses.replace(config, disk_cache=(folder, quota))
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}/v1"
    config = dataclasses.replace(config, url=url)
    show_server_log()
    print(f"atlas serve: {name} on {url} (loading...)", file=sys.stderr)
    if host not in LOOPBACK_NAMES and not api_key:
        print("atlas serve: listening beyond this machine without --api-key", file=sys.stderr)
    app = create_app(config)
    server = uvicorn.Server(uvicorn_config(app, log_level=log_level))
    server.run(sockets=[sock])


def with_defaults(resolved, sampling: SamplingOverrides | None, draft: int | None):
    """`resolved` with the server's own sampling and drafting over its recipe's defaults."""
    defaults = resolved.defaults
    if sampling is not None:
        defaults = dataclasses.replace(defaults, sampling=sampling.over(defaults.sampling))
    if draft is not None:
        defaults = dataclasses.replace(defaults, draft=draft)
    return dataclasses.replace(resolved, defaults=defaults)


@contextmanager
def running(model: str, *, device: str = "cpu", ctx_size: int | None = None) -> Iterator[str]:
    """`atlas serve MODEL` on a free loopback port, on a thread of this process, with the model
    loaded before it yields the server's URL: what the benchmarks measure when no --url is
    given (the prompts, parsers and grammars a client of `atlas serve` gets)."""
    import threading
    import time

    import uvicorn

    from atlas_cli import session

    resolved = session.resolve(model, device=device)
    loaded = session.load(resolved, ctx_size=ctx_size)
    config = ServeConfig(
        model=str(resolved.path),
        served_model_name=model,
        ctx_size=ctx_size,
        device=device,
        accept_any_model=True,
        tool_parser=known_parser(resolved.defaults.tool_call_parser),
        resolved=resolved,
    )
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(config, loaded), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise AtlasError("the in-process server stopped while starting")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
