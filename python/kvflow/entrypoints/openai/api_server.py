"""`python -m kvflow serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events
or not), GET /v1/models, POST /tokenize and /detokenize (as vLLM has them), GET /health, GET
/metrics (Prometheus). With an API key every /v1 route
wants `Authorization: Bearer KEY`. Errors come back as OpenAI error bodies, and a bad request
never disturbs the others. On SIGTERM or Ctrl-C the server stops admitting, lets requests in
flight finish for --shutdown-timeout seconds, aborts the rest, and exits 0."""

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException

from kvflow.engine.async_engine import AsyncLLMEngine, EngineStepError
from kvflow.engine.llm_engine import EngineDeadError
from kvflow.engine.metrics import EngineMetrics
from kvflow.engine.sampling_params import SamplingParamsError
from kvflow.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               TokenizeRequest, error_body)
from kvflow.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BYTES
from kvflow.entrypoints.openai.serving import OpenAIServing, QueueFullError

logger = logging.getLogger("kvflow")

API_KEY_ENV = "KVFLOW_API_KEY"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote the client's own text,
    which can hold a lone surrogate that UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(status: int, message: str, type_: str, param: str | None = None,
                    code: str | int | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(message, type_, param, code if code is not None else status),
                              status_code=status)


def _authorized(api_key: str | None, headers: list[tuple[bytes, bytes]]) -> bool:
    if api_key is None:
        return True
    value = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode())


class _RequestGuard:
    """Runs before routing and body parsing: the API key on /v1 routes (401 before anything of
    the body is read), then the body's size limit (413, from its Content-Length or as it arrives)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan; there are no websocket routes
            return await self.app(scope, receive, send)
        # The path as the router sees it: without a --root-path or a mount's prefix.
        if get_route_path(scope).startswith("/v1") and not _authorized(self.api_key, scope["headers"]):
            error = _error_response(401, "a valid API key is required (Authorization: Bearer KEY)",
                                    "authentication_error", code="invalid_api_key")
            return await error(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and not length.isdigit():
            error = _error_response(400, "the Content-Length header is not a number", "invalid_request_error")
            return await error(scope, receive, send)
        if length is not None and int(length) > self.max_request_bytes:
            error = _error_response(413, f"the request body is larger than {self.max_request_bytes} bytes",
                                    "invalid_request_error", code="request_too_large")
            return await error(scope, receive, send)
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise HTTPException(413, f"the request body is larger than {self.max_request_bytes} bytes")
            return message

        await self.app(scope, bounded_receive, send)


def _is_union_member(part) -> bool:
    """pydantic puts the member a value was tried as into the error's location
    (temperature.float): not a field the client sent."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in error.errors():
        location = [str(p) for p in item.get("loc", ()) if p != "body" and not _is_union_member(p)]
        if item.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        param = param or (".".join(location) or None)
        parts.append(f"{'.'.join(location) or 'body'}: {item.get('msg')}")
    return "; ".join(parts) or "invalid request", param


async def _unless_disconnected(request: Request, coroutine):
    """Awaits coroutine, cancelling it if the client goes away first: a non-streaming request
    whose client timed out must not keep its KV blocks until it finishes (a streaming response
    notices the disconnect itself)."""
    task = asyncio.ensure_future(coroutine)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


def _state(request: Request):
    return request.app.state


async def _check_accepting(request: Request) -> None:
    if _state(request).draining:
        raise APIError(503, "the server is shutting down", "service_unavailable")
    if _state(request).engine.dead is not None:
        raise APIError(503, f"the engine stopped: {_state(request).engine.dead}", "service_unavailable")


async def _respond(handler, body, request: Request):
    model_name = _state(request).model_name
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model `{body.model}` does not exist; this server serves `{model_name}`",
                       "invalid_request_error", "model", "model_not_found")
    try:
        result = await _unless_disconnected(request, handler(body))
    except QueueFullError as error:
        raise APIError(503, str(error), "service_unavailable") from error
    except EngineDeadError as error:
        raise APIError(503, f"the engine stopped: {error}", "service_unavailable") from error
    except EngineStepError as error:
        raise APIError(500, str(error), "internal_error") from error
    except SamplingParamsError as error:
        raise APIError(400, str(error), "invalid_request_error", error.field) from error
    except ValueError as error:
        raise APIError(400, str(error), "invalid_request_error") from error
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# Routes are module-level and reach the engine through app.state: FastAPI keeps every endpoint
# it has seen in process-wide caches, so an endpoint closing over the engine would keep it alive.
_v1 = APIRouter(prefix="/v1")  # the API key is checked before routing, by _RequestGuard
_root = APIRouter()


@_v1.get("/models")
async def _models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "kvflow", "max_model_len": state.engine.max_model_len}]}


@_v1.post("/completions", dependencies=[Depends(_check_accepting)])
async def _completions(body: CompletionRequest, request: Request):
    return await _respond(_state(request).serving.completions, body, request)


@_v1.post("/chat/completions", dependencies=[Depends(_check_accepting)])
async def _chat_completions(body: ChatCompletionRequest, request: Request):
    return await _respond(_state(request).serving.chat, body, request)


@_root.post("/tokenize")
async def _tokenize(body: TokenizeRequest, request: Request):
    return await _respond(_state(request).serving.tokenize, body, request)


@_root.post("/detokenize")
async def _detokenize(body: DetokenizeRequest, request: Request):
    return await _respond(_state(request).serving.detokenize, body, request)


@_root.get("/health")
async def _health(request: Request):
    state = _state(request)
    return Response(status_code=503 if state.draining or state.engine.dead is not None else 200)


@_root.get("/metrics")
async def _prometheus_metrics(request: Request):
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _api_error(request: Request, error: APIError):
    return _error_response(error.status, error.message, error.type, error.param, error.code)


async def _unexpected_error(request: Request, error: Exception):
    logger.exception("unexpected error serving %s", request.url.path)
    return _error_response(500, f"internal error: {type(error).__name__}: {error}", "internal_error")


async def _http_error(request: Request, error: HTTPException):
    kind = "invalid_request_error" if error.status_code < 500 else "internal_error"
    return _error_response(error.status_code, str(error.detail), kind)


async def _validation_error(request: Request, error: RequestValidationError):
    message, param = _validation_message(error)
    return _error_response(400, message, "invalid_request_error", param)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    await app.state.async_engine.abort_all()
    await app.state.async_engine.shutdown()
    app.state.serving.prompt_tokenizer.close()
    logger.info("kvflow server stopped; %d KV blocks in use", app.state.engine.allocator.num_used_blocks)


def build_app(async_engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_queue_len: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              tool_call_parser: str = "hermes") -> FastAPI:
    """The FastAPI application serving `async_engine` under `model_name`. max_queue_len counts
    samples (prompts x n); tool_call_parser: see tool_calls.TOOL_CALL_FORMATS."""
    metrics = EngineMetrics(async_engine.engine.stats, model_name)
    async_engine.on_finished = metrics.observe_finished
    app = FastAPI(title="kvflow", lifespan=_lifespan)
    app.state.engine = async_engine.engine
    app.state.async_engine = async_engine
    app.state.serving = OpenAIServing(async_engine, model_name, max_queue_len, max_prompts_per_request,
                                      tool_call_parser)
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.draining = False
    app.include_router(_v1)
    app.include_router(_root)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(_RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    return app


class _GracefulServer(uvicorn.Server):
    """At the first SIGTERM/SIGINT: the app stops admitting (new requests get 503), requests in
    flight get `drain_seconds` to finish, then the rest are aborted, so that their streams still
    end well-formed (finish_reason "abort", then [DONE]). Exits 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_seconds: float):
        super().__init__(config)
        self._app = app
        self._drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        first = not self._app.state.draining
        self._app.state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would re-raise it after shutdown: exit 0 instead
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def abort_late_requests():
            await asyncio.sleep(self._drain_seconds)
            await self._app.state.async_engine.abort_all()

        self._drain_task = asyncio.ensure_future(abort_late_requests())


def serve(args) -> int:
    from kvflow.entrypoints.cli_commands import build_engine_config
    from kvflow.loader.model_loader import DEFAULT_MODEL

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    async_engine = AsyncLLMEngine.from_config(build_engine_config(args))
    model_name = args.served_model_name or args.model or DEFAULT_MODEL
    app = build_app(async_engine, model_name, api_key, args.max_queue_len, args.max_request_bytes,
                    args.max_prompts_per_request, args.tool_call_parser)
    # uvicorn's own deadline comes after ours, by which time every stream has ended.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _GracefulServer(config, app, args.shutdown_timeout)
    logger.info("serving %s on http://%s:%d%s", model_name, args.host, args.port,
                " (API key required)" if api_key else "")
    server.run()
    return 0
