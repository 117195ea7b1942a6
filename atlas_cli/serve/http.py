"""What every endpoint module shares: the server's config and state, the endpoint wrapper
(API key, model readiness, errors in the endpoint's style, metrics), JSON body reading with
its size limit, disconnect watching, and server-sent events.

The endpoint modules (`openai_api`, `anthropic_api`, `service_api`) import this and never
`app.py`, which only lists their routes (vLLM's `entrypoints/openai` routers are the model).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from atlas_cli import __version__
from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import UsageError
from atlas_cli.serve.body import parse_json
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.memory import LARGE_BODY_BYTES, return_freed_memory
from atlas_cli.serve.metrics import Metrics
from atlas_cli.serve.prompt import Prompt, choose_parser
from atlas_cli.serve.protocol import parse_body
from atlas_cli.serve.runner import EngineRunner
from atlas_cli.serve.slot_files import DEFAULT_QUOTA as DEFAULT_SLOT_QUOTA
from atlas_cli.serve.toolcalls import NoToolParser, ToolParser
from atlas_cli.serve.turn import Turn

log = logging.getLogger("atlas.serve")

Body = TypeVar("Body", bound=BaseModel)

DEFAULT_MAX_BODY = 32 * 1024 * 1024  # a 256K-token prompt is ~1 MB of text; JSON adds little
BODY_TIMEOUT_S = 60.0  # a body that trickles in slower than this holds a connection for nothing


@dataclass(frozen=True)
class ServeConfig:
    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    ctx_size: int | None = None
    device: str = "cpu"
    kv_dtype: str | None = None  # a native device's KV cache (--kv-type); None: the recipe's
    max_body_bytes: int = DEFAULT_MAX_BODY
    # "hermes" | "qwen3_coder" | "none": overrides the parser chosen from the chat template
    tool_parser: str | None = None
    accept_any_model: bool = False  # llama-server's way: any model name means this model
    # defaults under each request's chat_template_kwargs, e.g. {"enable_thinking": False}
    template_kwargs: dict | None = None
    cache_bytes: int | None = None  # the prefix cache's budget (--cache-size); None: default
    # where and within what quota conversations are kept on disk (--cache-dir); None: nowhere
    disk_cache: tuple[Path, int] | None = None
    # `model` as atlas.session resolved it (path, device, the recipe's run defaults): the
    # server loads it with those defaults; None: open `model` by name or path here
    resolved: Any = None
    url: str | None = None  # where the API listens, for the "ready" line
    host: str = "127.0.0.1"  # the address it was bound to (browser_guard accepts it as a Host)
    # `/slots` save and restore read and write only here (--slot-save-path); None: refused
    slot_save_path: Path | None = None
    slot_save_quota: int = DEFAULT_SLOT_QUOTA  # bytes all files in that folder may hold


class AppState:
    """What the handlers share: the loaded model (None while loading), its runner, metrics."""

    def __init__(self, config: ServeConfig, model=None):
        self.config = config
        self.metrics = Metrics()
        self.created = int(time.time())
        self.model = None
        self.runner: EngineRunner | None = None
        self.parser: type[ToolParser] = NoToolParser
        self.load_error: str | None = None
        self.name = config.served_model_name or _default_name(config.model)
        self.aliases = {self.name, config.model}
        if model is not None:
            self.set_model(model)

    def set_model(self, model) -> None:
        self.parser = choose_parser(model.tokenizer.chat_template, self.config.tool_parser)
        self.runner = EngineRunner(model.engine, self.metrics, self.config.cache_bytes)
        if self.config.disk_cache is not None:
            model.engine.keep_on_disk(*self.config.disk_cache, Path(self.config.model))
        self.aliases.add(model.info.name)
        self.model = model

    def load(self) -> None:
        from atlas_cli import session
        from atlas_cli.errors import AtlasError

        config = self.config
        try:
            if config.resolved is not None:  # the recipe's run defaults come with it
                model = session.load(
                    config.resolved, ctx_size=config.ctx_size, kv_dtype=config.kv_dtype
                )
            else:
                model = session.open_model(
                    config.model,
                    device=config.device,
                    ctx_size=config.ctx_size,
                    kv_dtype=config.kv_dtype,
                )
        except AtlasError as exc:
            self.load_error = str(exc)
            log.error("atlas serve: could not load %s: %s", self.config.model, exc)
            return
        self.set_model(model)
        at = f" at {config.url}" if config.url else ""
        log.info("atlas serve: %s ready%s (context %d)", self.name, at, model.context_length)

    def ready(self):
        if self.model is not None:
            return self.model
        if self.load_error:
            raise APIError(500, f"the model failed to load: {self.load_error}", type="server_error")
        raise APIError(
            503,
            "the model is still loading; retry shortly",
            type="unavailable_error",
            code="model_loading",
        )

    def template_kwargs(self, given: dict | None = None) -> dict:
        """The server's chat-template defaults, overridden by the request's."""
        return {**(self.config.template_kwargs or {}), **(given or {})}

    def check_model(self, name: str | None) -> None:
        if name and name not in self.aliases and not self.config.accept_any_model:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.name!r}",
                code="model_not_found",
                param="model",
            )

    def new_turn(
        self, prompt: Prompt, *, max_tokens: int | None, stop: list[str], **given: Any
    ) -> Turn:
        """One answer on the loaded model: the sampling fields the client `given` (None for
        those it left out) over the model recipe's defaults."""
        sampling = SamplingOverrides(**given).over(self.model.defaults.sampling).params()
        return Turn(
            self.runner,
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            parser=self.parser,
        )


def _default_name(model: str) -> str:
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name or model)


# -- the endpoint wrapper and errors -----------------------------------------------------------

Handler = Callable[[AppState, Request], Awaitable[Response]]


def endpoint(name: str, *, style: str = "openai", auth: bool = True, model: bool = True):
    """Wrap a handler: API key, model readiness, errors in the endpoint's style, metrics."""

    def wrap(fn: Handler):
        async def handler(request: Request) -> Response:
            state: AppState = request.app.state.atlas
            try:
                if auth:
                    check_api_key(state, request)
                if model:
                    state.ready()
                response = await fn(state, request)
            except APIError as exc:
                response = error_response(exc, style)
            except UsageError as exc:  # a value the endpoint let through but the engine refuses
                response = error_response(APIError(400, str(exc), code="invalid_value"), style)
            except Exception as exc:
                log.exception("atlas serve: %s failed", name)
                response = error_response(
                    APIError(500, f"internal error: {exc}", type="server_error"), style
                )
            state.metrics.requests.labels(name, str(response.status_code)).inc()
            if getattr(request.state, "body_bytes", 0) >= LARGE_BODY_BYTES:
                await run_in_threadpool(return_freed_memory)  # its copies are garbage now
            return response

        return handler

    return wrap


def error_response(exc: APIError, style: str = "openai") -> Response:
    body = exc.anthropic_body() if style == "anthropic" else exc.openai_body()
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    # ASCII JSON: a message quoting the client's bad text (a lone surrogate) still encodes
    text = json.dumps(body, ensure_ascii=True)
    return Response(text, status_code=exc.status, headers=headers, media_type="application/json")


async def not_found(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405, in OpenAI's error shape."""
    return error_response(
        APIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code="not_found" if exc.status_code == 404 else "method_not_allowed",
        )
    )


def check_api_key(state: AppState, request: Request) -> None:
    key = state.config.api_key
    if not key:
        return
    given = request.headers.get("x-api-key", "")
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            "invalid API key: send the key given to `atlas serve --api-key` as "
            "'Authorization: Bearer KEY'",
            code="invalid_api_key",
        )


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
            code="invalid_value",
            param=param,
        )


# -- requests ----------------------------------------------------------------------------------


async def read_body(state: AppState, request: Request, kind: type[Body]) -> Body:
    """The request body as `kind` (a 400 naming the bad field), for this server's model. The
    bytes are parsed and validated on a worker thread: the event loop keeps serving."""
    raw = await read_bytes(state, request)
    body = await run_in_threadpool(_decode, raw, kind)
    state.check_model(getattr(body, "model", None))
    return body


def _decode(raw: bytearray, kind: type[Body]) -> Body:
    return parse_body(kind, parse_json(raw))


async def read_bytes(state: AppState, request: Request) -> bytearray:
    limit = state.config.max_body_bytes
    too_big = APIError(
        413,
        f"the request body is larger than the server's limit of {limit:,} bytes",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
                request.state.body_bytes = len(body)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="timeout"
        ) from None
    return body


@contextlib.asynccontextmanager
async def on_disconnect(request: Request, action: Callable[[], None]):
    """Run `action` if the client goes away before the block ends (non-streaming answers:
    a streaming response learns it from Starlette itself)."""

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                action()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def new_id(prefix: str) -> str:
    """A response id in the vendors' shape: `chatcmpl-…`, `cmpl-…`, `msg_…`."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def version_tag() -> str:
    return f"atlas-{__version__}"


# -- server-sent events ------------------------------------------------------------------------

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any, event: str | None = None) -> str:
    """One event: compact JSON data, under an `event:` name where the API has them."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def sse_response(
    turn: Turn,
    events: AsyncIterator[str],
    on_error: Callable[[APIError], str],
    last: str = "",
) -> StreamingResponse:
    """Stream a turn's events, then `last` (OpenAI's `[DONE]`). A failure mid-answer becomes
    an `on_error` event (the status line has gone out already); the turn stops when the
    stream ends for any reason, a client that went away included."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield on_error(exc)
        finally:
            turn.cancel()
        if last:
            yield last

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


def sampling_given(req: Any, budget: int | None) -> dict[str, Any]:
    """The sampling fields an OpenAI-style request sets (None: the defaults decide), and its
    thought budget as the API at hand reads it."""
    return {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repeat_penalty": req.repeat_penalty,
        "seed": req.seed,
        "reasoning_budget": budget,
    }
