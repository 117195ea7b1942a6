"""The ASGI app (Starlette): the routes of the endpoint modules, the 404/405 handler, the
browser guard (a server without a key refuses what web pages can send), and the lifespan.
The model loads on a thread at startup so `/health` can answer 503 while it does.

Nothing imports this module but the server entry (`server.py`) and tests: the endpoint
modules share `http.py` instead.
"""

from __future__ import annotations

import contextlib
import threading

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from atlas_cli.serve import anthropic_api, openai_api, service_api
from atlas_cli.serve.browser_guard import BrowserGuard
from atlas_cli.serve.http import AppState, ServeConfig, not_found
from atlas_cli.serve.responses_api import responses

# ServeConfig is re-exported: the server entry builds one and the app from this module alone
__all__ = ["ServeConfig", "create_app"]

ROUTES = [
    Route("/", service_api.front_door),
    Route("/health", service_api.health),
    Route("/v1/health", service_api.health),
    Route("/metrics", service_api.metrics),
    Route("/v1/models", service_api.list_models),
    Route("/v1/models/{model:path}", service_api.get_model),
    Route("/tokenize", service_api.tokenize, methods=["POST"]),
    Route("/detokenize", service_api.detokenize, methods=["POST"]),
    Route("/slots", service_api.list_slots),
    Route("/slots/{slot}", service_api.slot_action, methods=["POST"]),
    Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_api.completions, methods=["POST"]),
    Route("/completions", openai_api.completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
]


def create_app(config: ServeConfig, model=None) -> Starlette:
    """The app; with `model` (a loaded `atlas_cli.backend.Model`) it is ready at once,
    otherwise it loads `config.model` on a thread at startup."""
    state = AppState(config, model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.model is None and not state.load_error:
            threading.Thread(target=state.load, name="atlas-load", daemon=True).start()
        yield
        if state.runner is not None:
            state.runner.shutdown()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found},
        middleware=[Middleware(BrowserGuard, bound=config.host, api_key=config.api_key)],
    )
    app.state.atlas = state
    return app
