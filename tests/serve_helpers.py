"""Helpers for the server tests: run an app under uvicorn on a free loopback port in a thread,
and a scripted engine that replays a fixed answer (to test parsing of outputs the real small
model does not produce)."""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from types import SimpleNamespace

import uvicorn

from atlas_cli.backend.choice import Choice
from atlas_cli.backend.defaults import RunDefaults
from atlas_cli.backend.engine import TokenEvent


class ServerThread:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def free_port() -> int:
    """A loopback port nothing listens on now (for a server started as its own process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(port: int, proc) -> int | None:
    """Poll a server process's /health every 100 ms (as Lemonade does) until it answers 200,
    the process ends or two minutes pass; the last status."""
    status = None
    for _ in range(1200):
        if proc.poll() is not None:
            break
        try:
            status, _, _ = raw_request(port, "GET", "/health")
        except OSError:
            status = None
        if status == 200:
            break
        time.sleep(0.1)
    return status


def raw_request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP request (for what the SDKs will not send: broken JSON, raw SSE); a body is
    sent as JSON unless `headers` give its type."""
    headers = dict(headers or {})
    if body is not None and not any(k.lower() == "content-type" for k in headers):
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def metric(port: int, name: str, labels: str = "", key: str | None = None) -> float:
    """One sample's value from /metrics (0 when absent); `key`: the server's API key."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    _, _, body = raw_request(port, "GET", "/metrics", headers=headers)
    key = f"{name}{{{labels}}}" if labels else name
    for line in body.decode().splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


class ScriptedEngine:
    """Stands in for `Engine`: answers every prompt with `script` (text pieces; an exception in
    it is raised there)."""

    def __init__(self, tokenizer, context_length: int = 2048):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.cached_ids: list[int] = []
        self.script: list[str] = []
        self.prompts: list[list[int]] = []
        self.pool = SimpleNamespace(budget=0)  # the prefix cache the server sizes
        self.disk = None  # and keeps nothing on disk

    def choose_call(self, ids, null_ids, opening) -> Choice:
        """tool_choice auto's decision: a reply (the script is the answer either way)."""
        return Choice(False, -math.inf, -math.inf)

    def generate(self, ids, *, max_tokens, sampling, stop, stats, **_):
        self.prompts.append(list(ids))
        stats.prompt_tokens = len(ids)
        stats.finish_reason = "stop"
        for piece in self.script[:max_tokens]:
            if isinstance(piece, Exception):  # a scripted engine failure
                raise piece
            stats.completion_tokens += 1
            stats.text += piece
            yield TokenEvent(-1, piece)
        if len(self.script) > max_tokens:
            stats.finish_reason = "length"


def scripted_model(tokenizer) -> SimpleNamespace:
    engine = ScriptedEngine(tokenizer)
    info = SimpleNamespace(name="scripted", architecture="llama", file_type="none")
    return SimpleNamespace(
        engine=engine,
        tokenizer=tokenizer,
        info=info,
        context_length=engine.context_length,
        defaults=RunDefaults(),
    )


def sse_events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()


# a question and a tool the server tests share
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def streamed_call(chunks) -> tuple[str, str, str]:
    """(name, arguments, finish reason) reassembled from OpenAI tool-call deltas."""
    name, args, finish = "", "", None
    for chunk in chunks:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            name += delta.function.name or ""
            args += delta.function.arguments or ""
    return name, args, finish
