"""The endpoints that do not generate: the front door (`GET /`), health, models, tokenize /
detokenize (llama.cpp's and vLLM's field names both work), Prometheus metrics, and
llama-server's `/slots` (list the prefix cache's sequences; save one to disk, restore or erase
it)."""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from atlas_cli.errors import SlotError, SlotNotFoundError, StoreError
from atlas_cli.serve.body import parse_json
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.http import (
    AppState,
    check_api_key,
    check_token_ids,
    endpoint,
    error_response,
    read_body,
    read_bytes,
)
from atlas_cli.serve.prompt import ChatOptions, build_chat_prompt
from atlas_cli.serve.protocol import DetokenizeRequest, TokenizeRequest
from atlas_cli.serve.slot_files import save_within_quota, slot_file

SLOT_ID = re.compile(r"[0-9]{1,9}")


async def front_door(request: Request) -> Response:
    """`GET /`: what this server is and where its APIs live (no key needed: it says nothing
    about the model beyond its name)."""
    from atlas_cli import __version__

    state: AppState = request.app.state.atlas
    status = "ok" if state.model is not None else "error" if state.load_error else "loading"
    return JSONResponse(
        {
            "server": f"atlas {__version__}",
            "model": state.name,
            "status": status,
            "openai": "/v1 (POST /v1/chat/completions, /v1/completions, /v1/responses; "
            "GET /v1/models)",
            "anthropic": "POST /v1/messages",
            "health": "/health",
            "metrics": "/metrics",
        }
    )


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
    req = await read_body(state, request, TokenizeRequest)
    # a long text takes a while to render and tokenise: not on the event loop
    return await run_in_threadpool(_tokenize, state, req)


def _tokenize(state: AppState, req: TokenizeRequest) -> JSONResponse:
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
    req = await read_body(state, request, DetokenizeRequest)
    check_token_ids(req.tokens, state.model.tokenizer.vocab_size, "tokens")
    text = await run_in_threadpool(state.model.tokenizer.decode, req.tokens)
    return JSONResponse({"content": text, "prompt": text})


async def metrics(request: Request) -> Response:
    """Prometheus text, behind the API key when there is one (its counts say how the server is
    used), and not counted in itself."""
    state: AppState = request.app.state.atlas
    try:
        check_api_key(state, request)
    except APIError as exc:
        return error_response(exc)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@endpoint("slots")
async def list_slots(state: AppState, request: Request) -> Response:
    return JSONResponse(await state.runner.call(state.model.engine.slots))


@endpoint("slots")
async def slot_action(state: AppState, request: Request) -> Response:
    """`POST /slots/{id}?action=save|restore` with `{"filename": NAME}`, or `?action=erase`.
    Files live in the `--slot-save-path` folder (without one, save and restore are refused, as
    llama-server refuses them); NAME is a plain file name."""
    raw, action = request.path_params["slot"], request.query_params.get("action")
    # ASCII digits only, and few: str.isdigit takes "²" (which int() refuses) and int() takes
    # "١", and past 4,300 digits int() raises
    if not SLOT_ID.fullmatch(raw):
        raise APIError(400, f"slot id must be a number, got {raw[:20]!r}", param="id_slot")
    slot_id, engine, started = int(raw), state.model.engine, time.perf_counter()
    try:
        if action == "erase":
            n = await state.runner.call(lambda: engine.erase_slot(slot_id))
            return JSONResponse({"id_slot": slot_id, "n_erased": n})
        if action not in ("save", "restore"):
            raise APIError(400, "action must be save, restore or erase", param="action")
        folder, quota = state.config.slot_save_path, state.config.slot_save_quota
        if folder is None:
            raise APIError(
                501,
                f"slot {action} is off: start the server with --slot-save-path DIR",
                type="not_supported_error",
                code="slot_save_disabled",
            )
        body = parse_json(await read_bytes(state, request))  # small: on the loop
        name = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "give the slot file's name as 'filename'", param="filename")
        path = slot_file(folder, name)
        if action == "save":
            n, size = await state.runner.call(
                lambda: save_within_quota(engine, slot_id, path, quota)
            )
            counts = {"n_saved": n, "n_written": size}
        else:
            n, size = await state.runner.call(lambda: engine.restore_slot(slot_id, path))
            counts = {"n_restored": n, "n_read": size}
    except SlotError as exc:
        status = 404 if isinstance(exc, SlotNotFoundError) else 400
        raise APIError(status, str(exc), param="filename") from None
    except StoreError as exc:  # the folder became unwritable, or its disk is full
        raise APIError(507, str(exc), type="server_error", code="slot_save_failed") from None
    ms = (time.perf_counter() - started) * 1000
    timings = {f"{action}_ms": round(ms, 3)}
    return JSONResponse({"id_slot": slot_id, "filename": name, **counts, "timings": timings})
