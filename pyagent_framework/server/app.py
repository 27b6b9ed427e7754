"""The FastAPI application: routes, API key, body-size cap and the error shape.

Every failure a client can cause is answered in OpenAI's error shape with a 4xx
status: 400 bad value or cap exceeded, 401 API key, 404 unknown model or route, 413
body too large, 422 body does not match the schema, 503 engine stopped.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyagent_framework.engine.async_llm import AsyncLLM
from pyagent_framework.server import protocol as api, responses, score
from pyagent_framework.server.config import ServerConfig
from pyagent_framework.server.errors import ERROR_RESPONSES, APIError, error_body
from pyagent_framework.server.metrics import ServerMetrics
from pyagent_framework.server.serving import OpenAIServing
from pyagent_framework.server.streaming import Events, as_api_error
from pyagent_framework.server.tracing import REQUEST_HEADERS, Tracing

logger = logging.getLogger("pyagent_framework.server")


#: Routes behind the API key besides /v1/*.
OPERATOR_PATHS = frozenset({"/start_profile", "/stop_profile"})


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code).model_dump(), status_code=status)


class EventStream(StreamingResponse):
    """Server-sent events that stop (and abort the request in the engine) as soon as
    the client disconnects, whatever ASGI version the server speaks."""

    def __init__(self, events: Events) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection broke mid-write
                        pass
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            await self.events.aclose()


async def until_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a coroutine) unless the client hangs up first; then cancel it, so
    the request is aborted in the engine and its KV blocks freed."""
    task = asyncio.ensure_future(work)

    async def hung_up() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(hung_up())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (shutdown): never orphan the work
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task
    except (asyncio.CancelledError, APIError):
        pass
    return Response(status_code=499)  # nobody reads it: the client is gone


class InternalErrors:
    """ASGI middleware: an exception nothing else handled becomes a 500 in the error
    shape, and the connection stays usable. (Starlette's own last-resort handler
    re-raises after answering, and the HTTP server then drops the keep-alive connection.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unexpected error serving %s", scope.get("path"))
            if not started:
                body = error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
                await body(scope, receive, send)


class Guard:
    """ASGI middleware in front of the app: the API key on ``/v1/*`` and the operator
    routes (401), then the
    body-size cap (413, by Content-Length, or counted as a chunked body streams in)."""

    def __init__(self, app, *, limit: int, api_key: str | None) -> None:
        self.app = app
        self.limit = limit
        self.api_key = api_key.encode() if api_key else None

    def __getattr__(self, name: str) -> Any:  # reach the FastAPI app (openapi, routes, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if self.api_key is not None and (scope["path"].startswith("/v1") or scope["path"] in OPERATOR_PATHS):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                message = "missing or incorrect API key (send 'Authorization: Bearer KEY')"
                return await error_response(401, message, code="invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(400, "bad Content-Length header")(scope, receive, send)
            if int(length) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        # No Content-Length (a chunked body): read it here, counting, then replay it.
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            body.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body is larger than this server's limit of {self.limit} bytes"
        await error_response(413, message, code="request_too_large")(scope, receive, send)


def build_app(engine: AsyncLLM, config: ServerConfig, *, model_name: str, span_exporter: Any = None) -> Guard:
    """The ASGI app over a running :class:`AsyncLLM`; the caller owns the engine
    (several apps may share one) and shuts it down. ``span_exporter``: trace requests
    to this OpenTelemetry exporter (tests), as ``--otlp-traces-endpoint`` does."""
    metrics = ServerMetrics(engine.stats, model_name)
    if config.otlp_traces_endpoint or span_exporter is not None:
        metrics.tracing = Tracing(config.otlp_traces_endpoint, exporter=span_exporter)
    serving = OpenAIServing(engine, config, model_name=model_name, metrics=metrics)

    app = FastAPI(title="pyagent-framework", version="1", responses=ERROR_RESPONSES)
    app.state.serving = serving
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") in ("invalid_unicode", "unsupported_field"):  # a bad value, not a bad shape
            context = first.get("ctx", {})
            return error_response(400, first["msg"], param=context.get("where") or context.get("field"), code=first["type"])
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), code="invalid_json")
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
        )
        return error_response(422, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's Allow, for one
        return response

    app.add_middleware(InternalErrors)

    @app.get("/health", response_model=api.HealthResponse, responses={503: ERROR_RESPONSES[503]})
    async def health():
        if not engine.is_alive:
            return error_response(503, f"the engine has stopped: {engine.error!r}", code="engine_dead")
        return api.HealthResponse()

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics():
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=api.ModelList)
    async def models():
        return serving.models()

    @app.post(
        "/v1/chat/completions",
        response_model=api.ChatCompletionResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "A chat.completion, or chunks when stream=true"}},
    )
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        REQUEST_HEADERS.set(request.headers)
        return await until_disconnected(request, respond(serving.chat(body)))

    @app.post(
        "/v1/completions",
        response_model=api.CompletionResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "A text_completion, or chunks when stream=true"}},
    )
    async def completions(body: api.CompletionRequest, request: Request):
        REQUEST_HEADERS.set(request.headers)
        return await until_disconnected(request, respond(serving.completion(body)))

    @app.post(
        "/v1/responses",
        response_model=responses.ResponseObject,
        responses={200: {"content": {"text/event-stream": {}}, "description": "A response, or its events when stream=true"},
                   404: {"model": api.ErrorResponse, "description": "Unknown model or previous_response_id"}},
    )
    async def create_response(body: responses.ResponsesRequest, request: Request):
        REQUEST_HEADERS.set(request.headers)
        return await until_disconnected(request, respond(serving.responses(body)))

    @app.get("/v1/responses/{response_id}", response_model=responses.ResponseObject,
             responses={404: {"model": api.ErrorResponse, "description": "No stored response has this id"}})
    async def retrieve_response(response_id: str):
        return serving.retrieve_response(response_id)

    @app.delete("/v1/responses/{response_id}", response_model=responses.DeletedResponse,
                responses={404: {"model": api.ErrorResponse, "description": "No stored response has this id"}})
    async def delete_response(response_id: str):
        return serving.delete_response(response_id)

    @app.post("/v1/embeddings", response_model=api.EmbeddingResponse)
    async def embeddings(body: api.EmbeddingRequest, request: Request):
        return await until_disconnected(request, respond(serving.embeddings(body)))

    @app.post("/v1/score", response_model=score.ScoreResponse)
    async def score_pairs(body: score.ScoreRequest, request: Request):
        return await until_disconnected(request, respond(serving.score(body)))

    @app.post("/rerank", response_model=score.RerankResponse)
    @app.post("/v1/rerank", response_model=score.RerankResponse)
    async def rerank(body: score.RerankRequest, request: Request):
        return await until_disconnected(request, respond(serving.rerank(body)))

    @app.post("/tokenize", response_model=api.TokenizeResponse)
    async def tokenize(body: api.TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=api.DetokenizeResponse)
    async def detokenize(body: api.DetokenizeRequest):
        return serving.detokenize(body)

    if config.allow_runtime_lora_updating:  # the operator's switch: the routes do not exist otherwise

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: api.LoadLoRAAdapterRequest):
            await lora_call(engine.add_lora(body.lora_name, body.lora_path))
            return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: api.UnloadLoRAAdapterRequest):
            await lora_call(engine.remove_lora(body.lora_name))
            return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")

    if config.profiler_dir:  # the operator's switch: the routes do not exist otherwise

        @app.post("/start_profile")
        async def start_profile():
            await asyncio.to_thread(profile_call, engine.engine.start_profile, config.profiler_dir)
            return {"status": "started", "directory": config.profiler_dir}

        @app.post("/stop_profile")
        async def stop_profile():
            return {"status": "stopped", "traces": await asyncio.to_thread(profile_call, engine.engine.stop_profile)}

    return Guard(app, limit=config.max_request_bytes, api_key=config.api_key)


async def lora_call(work) -> None:
    """Load or unload an adapter; what is wrong with it is a 400 naming it."""
    from pyagent_framework.engine.core_client import EngineDeadError
    from pyagent_framework.engine.errors import InvalidRequestError

    try:
        await work
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None


def profile_call(method, *args):
    """A profiler call in the engine core; "already running" and "not running" are 409s."""
    from pyagent_framework.engine.errors import InvalidRequestError

    try:
        return method(*args)
    except (InvalidRequestError, RuntimeError) as exc:
        raise APIError(409, str(exc), code="profile_state") from None


async def respond(result) -> Any:
    try:
        out = await result
    except APIError:
        raise
    except Exception as exc:  # a plugin raised while the response was built
        raise as_api_error(exc) from None
    if isinstance(out, api.BaseModel):
        return JSONResponse(out.model_dump(mode="json"))
    return EventStream(out)
