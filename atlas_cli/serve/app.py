"""The ASGI app (Starlette): routes, API-key check, body limit, errors in OpenAI's shape, and
the endpoints that do not generate (health, models, tokenize, metrics).

The model loads on a thread at startup so `/health` can answer 503 while it does.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from atlas_cli import __version__
from atlas_cli.backend.toolcalls import NoToolParser, ToolParser
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.metrics import Metrics
from atlas_cli.serve.prompt import ChatOptions, build_chat_prompt, choose_parser
from atlas_cli.serve.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from atlas_cli.serve.runner import EngineRunner

log = logging.getLogger("atlas.serve")

DEFAULT_MAX_BODY = 32 * 1024 * 1024  # a 256K-token prompt is ~1 MB of text; JSON adds little


@dataclass(frozen=True)
class ServeConfig:
    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    ctx_size: int | None = None
    device: str = "cpu"
    max_body_bytes: int = DEFAULT_MAX_BODY
    # "hermes" | "qwen3_coder" | "none": overrides the parser chosen from the chat template
    tool_parser: str | None = None
    accept_any_model: bool = False  # llama-server's way: any model name means this model
    # defaults under each request's chat_template_kwargs, e.g. {"enable_thinking": False}
    template_kwargs: dict | None = None
    # `model` as atlas.session resolved it (path, device, the recipe's run defaults): the
    # server loads it with those defaults; None: open `model` by name or path here
    resolved: Any = None


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
        self.runner = EngineRunner(model.engine, self.metrics)
        self.aliases.add(model.info.name)
        self.model = model

    def load(self) -> None:
        from atlas_cli import session
        from atlas_cli.errors import AtlasError

        config = self.config
        try:
            if config.resolved is not None:  # the recipe's run defaults come with it
                model = session.load(config.resolved, ctx_size=config.ctx_size)
            else:
                model = session.open_model(
                    config.model, device=config.device, ctx_size=config.ctx_size
                )
        except AtlasError as exc:
            self.load_error = str(exc)
            log.error("atlas serve: could not load %s: %s", self.config.model, exc)
            return
        self.set_model(model)
        log.info("atlas serve: %s ready (context %d)", self.name, model.context_length)

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


def _default_name(model: str) -> str:
    from pathlib import Path

    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name or model)


# -- request plumbing --------------------------------------------------------------------------

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
            except Exception as exc:
                log.exception("atlas serve: %s failed", name)
                response = error_response(
                    APIError(500, f"internal error: {exc}", type="server_error"), style
                )
            state.metrics.requests.labels(name, str(response.status_code)).inc()
            return response

        return handler

    return wrap


def error_response(exc: APIError, style: str = "openai") -> JSONResponse:
    body = exc.anthropic_body() if style == "anthropic" else exc.openai_body()
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(body, status_code=exc.status, headers=headers)


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


async def read_json(state: AppState, request: Request) -> Any:
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
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except ValueError as exc:
        raise APIError(
            400, f"the request body is not valid JSON ({exc})", code="invalid_json"
        ) from None


@contextlib.asynccontextmanager
async def on_disconnect(request: Request, action: Callable[[], None]):
    """Run `action` if the client goes away before the block ends (non-streaming answers:
    a streaming response learns it from Starlette itself)."""
    import asyncio

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


# -- endpoints that do not generate ------------------------------------------------------------


async def health(request: Request) -> Response:
    state: AppState = request.app.state.atlas
    if state.model is not None:
        return JSONResponse({"status": "ok"})
    if state.load_error:
        return JSONResponse({"status": "error", "message": state.load_error}, status_code=500)
    return JSONResponse({"status": "loading"}, status_code=503)


def model_card(state: AppState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.name,
        "object": "model",
        "created": state.created,
        "owned_by": "atlas",
    }
    if state.model is not None:
        card["meta"] = {
            "context_length": state.model.context_length,
            "architecture": state.model.info.architecture,
            "file_type": state.model.info.file_type,
        }
    return card


@endpoint("models", model=False)
async def list_models(state: AppState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [model_card(state)]})


@endpoint("models", model=False)
async def get_model(state: AppState, request: Request) -> Response:
    state.check_model(request.path_params["model"])
    return JSONResponse(model_card(state))


@endpoint("tokenize")
async def tokenize(state: AppState, request: Request) -> Response:
    req = parse_body(TokenizeRequest, await read_json(state, request))
    state.check_model(req.model)
    tok = state.model.tokenizer
    if req.messages is not None:
        opts = ChatOptions(
            parser=state.parser,
            tools=req.tools,
            template_kwargs=state.template_kwargs(req.chat_template_kwargs),
            add_generation_prompt=req.add_generation_prompt,
        )
        ids = build_chat_prompt(tok, req.messages, opts).ids
    else:
        text = req.content if req.content is not None else req.prompt
        if text is None:
            raise APIError(400, "give 'content' (or 'prompt', or 'messages')", param="content")
        special = req.add_special if req.add_special is not None else req.add_special_tokens
        ids = tok.encode(text, add_special_tokens=bool(special))
    tokens: list[Any] = ids
    if req.with_pieces:
        tokens = [{"id": i, "piece": tok.decode([i])} for i in ids]
    return JSONResponse(
        {"tokens": tokens, "count": len(ids), "max_model_len": state.model.context_length}
    )


@endpoint("detokenize")
async def detokenize(state: AppState, request: Request) -> Response:
    req = parse_body(DetokenizeRequest, await read_json(state, request))
    state.check_model(req.model)
    check_token_ids(req.tokens, state.model.tokenizer.vocab_size, "tokens")
    text = state.model.tokenizer.decode(req.tokens)
    return JSONResponse({"content": text, "prompt": text})


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
            code="invalid_value",
            param=param,
        )


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.atlas
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def not_found(request: Request, exc: HTTPException) -> Response:
    return error_response(
        APIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code="not_found" if exc.status_code == 404 else "method_not_allowed",
        )
    )


def create_app(config: ServeConfig, model=None) -> Starlette:
    """The app; with `model` (a loaded `atlas_cli.backend.Model`) it is ready at once,
    otherwise it loads `config.model` on a thread at startup."""
    from atlas_cli.serve import anthropic_api, openai_api

    state = AppState(config, model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.model is None and not state.load_error:
            threading.Thread(target=state.load, name="atlas-load", daemon=True).start()
        yield
        if state.runner is not None:
            state.runner.shutdown()

    routes = [
        Route("/health", health),
        Route("/v1/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found},
    )
    app.state.atlas = state
    return app


def version_tag() -> str:
    return f"atlas-{__version__}"
