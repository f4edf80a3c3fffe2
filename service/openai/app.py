"""The FastAPI application of the OpenAI-compatible API (docs/architecture.md section 8).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stateless),
GET /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /metrics. Every refusal
is an OpenAI error body; FastAPI's and Starlette's own errors (422 validation, 404 route,
405 method) are turned into one too, and an unexpected failure answers 500 without
details.

A client that goes away aborts its request: a stream notices at once (its disconnect
is watched beside the events it sends), a whole response as well (its disconnect
cancels the wait); either way the engine frees the request's KV-cache blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedinfer.service.openai import chat, completions, render, responses
from pagedinfer.service.openai.errors import APIError, from_errors, from_validation_error
from pagedinfer.service.openai.openapi import install_openapi
from pagedinfer.service.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedinfer.service.openai.serving import (
    AbortedError,
    ServingState,
    chat_messages,
    check_token_ids,
    encode,
    sse_error,
)

log = logging.getLogger("pagedinfer.http")

MAX_BODY_BYTES = 32 * 2**20
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers send no credentials
Body = TypeVar("Body", bound=BaseModel)


def create_app(state: ServingState, auth_token: str | None = None) -> FastAPI:
    """The API over `state`; with `auth_token`, every route but /health and /metrics
    needs `Authorization: Bearer <auth_token>`."""
    app = FastAPI(
        title="pagedinfer", summary="OpenAI-compatible API", docs_url=None, redoc_url=None
    )
    if auth_token:
        app.add_middleware(BearerAuth, token=auth_token)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None or state.draining:
            status = "draining" if state.draining else "loading"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = getattr(state.telemetry, "registry", None)
        if registry is None:
            raise APIError(404, "metrics are not enabled on this server")
        # Collecting walks every instrument: off the event loop.
        text = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        engine = state.engine
        if engine is None:
            raise APIError(503, "the model is still loading", code="unavailable")
        cards = [
            ModelCard(
                id=name,
                created=state.created,
                root=engine.model_name,
                max_model_len=engine.max_model_len,
            )
            for name in state.served_model_names
        ]
        return ModelList(data=cards)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await _generate(
            request,
            state,
            body,
            completions.start_completion,
            completions.complete,
            completions.stream,
        )

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await _generate(request, state, body, chat.start_chat, chat.complete, chat.stream)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await parse(request, responses.ResponsesRequest)
        return await _generate(
            request,
            state,
            body,
            responses.start_response,
            responses.complete,
            responses.stream,
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await parse(request, TokenizeRequest)
        engine = state.ready_engine()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            if not body.prompt:
                raise APIError(400, "prompt must not be empty", param="prompt")
            ids = encode(engine, "prompt", prompt=body.prompt)
        else:
            messages = chat_messages(ChatCompletionRequest(messages=body.messages))
            ids = encode(engine, "messages", messages=messages)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    # vLLM's render API: the prompt token ids a router keys KV-cache events by.
    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return JSONResponse(render.render_completion(state, body))

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return JSONResponse(render.render_chat(state, body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await parse(request, DetokenizeRequest)
        engine = state.ready_engine()
        state.check_model(body.model)
        check_token_ids(body.tokens, engine.vocab_size, "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    install_openapi(app, {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/responses": responses.ResponsesRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    })  # fmt: skip
    return app


async def parse(request: Request, model: type[Body]) -> Body:
    """The request body as `model`: 400 naming the field for anything wrong with it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _generate(
    request: Request,
    state: ServingState,
    body: Any,
    start: Callable[[ServingState, Any], Any],
    complete: Callable[[Any], Awaitable[BaseModel]],
    stream: Callable[[Any], AsyncIterator[bytes]],
) -> Response:
    job = start(state, body)  # raises APIError before anything is queued
    if body.stream:
        return EventStream(stream(job), state)
    work = asyncio.ensure_future(complete(job))
    state.enter(work.cancel)
    try:
        result = await until_disconnected(request.receive, work)
    except AbortedError as exc:
        raise APIError(503, str(exc), code="aborted") from None
    finally:
        state.leave(work.cancel)
    if result is DISCONNECTED:  # nobody reads this
        return Response(status_code=499)
    if result is CUT:
        raise APIError(503, SHUT_DOWN, code="unavailable")
    return Response(result.model_dump_json(), media_type="application/json")


DISCONNECTED, CUT = object(), object()
SHUT_DOWN = "the server shut down before the response was complete"


async def until_disconnected(receive: Receive, work: asyncio.Future) -> Any:
    """The result of `work`; DISCONNECTED after cancelling it when the client goes away,
    CUT when something else cancelled it."""
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done() and not watcher.cancelled()
        for t in (work, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if gone:
        return DISCONNECTED
    if work.cancelled():
        return CUT
    return work.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events that stop, and abort their request, when the client leaves.

    Sending runs beside a watch on the connection, so a disconnect is noticed even
    while no event is due (a request waiting in the queue); whichever ends first
    cancels the other. A drain's deadline cuts the stream: it ends with an error event.
    """

    def __init__(self, events: AsyncIterator[bytes], state: ServingState) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._state = state
        self._sending: asyncio.Future | None = None
        self._started = self._cut = False
        state.enter(self.cut)

    def cut(self) -> None:
        self._cut = True
        if self._sending is not None:
            self._sending.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            sending = self._sending = asyncio.ensure_future(self._send_events(send))
            if self._cut:
                sending.cancel()
            watcher = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone = watcher.done() and not watcher.cancelled()
                for t in (sending, watcher):
                    if not t.done():
                        t.cancel()
                await asyncio.gather(sending, watcher, return_exceptions=True)
            if sending.cancelled():
                if self._cut and not gone:
                    await self._send_cut(send)
            elif (error := sending.exception()) is not None and not isinstance(error, OSError):
                raise error  # an OSError means the client left mid-send
        finally:
            self._state.leave(self.cut)

    async def _send_cut(self, send: Send) -> None:
        with contextlib.suppress(OSError):
            if not self._started:
                await send(self._start_message())
            event = sse_error(503, SHUT_DOWN) + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})

    def _start_message(self) -> Message:
        return {"type": "http.response.start", "status": self.status_code,
                "headers": self.raw_headers}  # fmt: skip

    async def _send_events(self, send: Send) -> None:
        await send(self._start_message())
        self._started = True
        async with contextlib.aclosing(self._events) as events:
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class BearerAuth:
    """ASGI middleware: 401 without `Authorization: Bearer <token>`, except OPEN_PATHS."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid bearer token", code="invalid_api_key")
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await _drain_body(receive)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _drain_body(receive: Receive) -> None:
    """Reads the refused request's body, so the connection can carry the next request."""
    message: Message = {"more_body": True}
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            return


def _add_error_handlers(app: FastAPI) -> None:
    def error_response(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_errors(list(exc.errors()), skip=1))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: "no such route", 405: "method not allowed on this route"}
        message = messages.get(exc.status_code, str(exc.detail))
        code = "not_found" if exc.status_code == 404 else None
        return error_response(
            APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc, extra={"path": request.url.path})
        return error_response(APIError(500, "internal server error"))
