"""The OpenAI-compatible FastAPI app: routes, API-key check, OpenAI-style errors, lifespan."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4.server.async_engine import AsyncEngine
from dsv4.server.chat import create_chat_completion
from dsv4.server.completions import create_completion
from dsv4.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_response
from dsv4.server.state import ServerState

log = logging.getLogger("dsv4.server")


def _loc_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first: dict[str, Any] = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"Invalid JSON body: {first.get('msg', 'cannot parse')}",
                        code="invalid_json")
    if not loc or (len(loc) == 1 and isinstance(loc[0], int)):
        return ApiError(400, "The request body must be a JSON object: "
                             f"{first.get('msg', 'invalid body')}", code="invalid_body")
    param = _loc_path(loc)
    value = first.get("input")
    shown = "" if first.get("type") == "missing" else f" (found {value!r:.80})"
    return ApiError(400, f"{param}: {first.get('msg', 'invalid value')}{shown}", param=param)


class _ApiKeyMiddleware:
    """``/v1/*`` needs ``Authorization: Bearer <key>``; a plain ASGI middleware, so that
    streaming and disconnect detection pass through untouched."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = ""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value.decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), (self.state.api_key or "").encode()):
                self.state.metrics.count_request("unauthorized")
                response = error_response(ApiError(
                    401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, default_thinking: bool = False,
              manage_engine: bool = True) -> FastAPI:
    """The app serving ``engine`` under ``model_name``.

    With ``manage_engine`` the app's lifespan starts the engine thread and stops it at
    shutdown (uvicorn runs the shutdown on SIGTERM / SIGINT after draining connections).
    """
    state = ServerState(engine, model_name, api_key=api_key, max_model_len=max_model_len,
                        default_thinking=default_thinking)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    app = FastAPI(title="dsv4", version="0.1.0", lifespan=lifespan)
    app.state.dsv4 = state

    if api_key:
        app.add_middleware(_ApiKeyMiddleware, state=state)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        if not exc.counted:
            state.metrics.count_request("bad_request" if exc.status < 500 else "error")
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        state.metrics.count_request("bad_request")
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        state.metrics.count_request("error")
        return error_response(ApiError(500, f"Internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(engine.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card: dict[str, Any] = {"id": state.model_name, "object": "model",
                                "created": state.created, "owned_by": "dsv4"}
        if state.max_model_len:
            card["max_model_len"] = state.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(state, body, request)

    return app
