"""The gateway's HTTP routes (FastAPI): OpenAI's completions, chat completions and models, plus /health, in front of
one draft service reached through specwire's async SDK. Streaming is server-sent events; a client that goes away
cancels its generation on both services."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.security import TokenFile, read_file, read_token
from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    finish_reason,
    from_grpc,
    new_id,
    now,
    stats_extension,
    usage,
)
from specwire.client import AsyncClient, Chunk, Result
from specwire.errors import SpecwireError

log = structlog.get_logger(__name__)

HEALTH_TIMEOUT_S = 2.0
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
DISCONNECT_POLL_S = 0.25
_HTTP_ERRORS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}


def model_name(config: GatewayConfig) -> str:
    if config.model_name:
        return config.model_name
    return Path(config.tokenizer).name if config.tokenizer else "specwire"


def connect(config: GatewayConfig) -> AsyncClient:
    """The SDK client of the draft service, with the gateway's credentials for it."""
    def pem(path: str | None, what: str) -> bytes | None:
        return read_file(path, what) if path else None

    return AsyncClient(config.server, timeout=config.request_timeout_s, connect_timeout=5.0,
                       token=read_token(config.server_token_file) if config.server_token_file else None,
                       root_certificates=pem(config.server_ca, "draft service CA"),
                       certificate_chain=pem(config.server_cert, "client certificate"),
                       private_key=pem(config.server_key, "client key"), tls_server_name=config.server_tls_name)


class GatewayMetrics:
    """Prometheus metrics of the gateway, served at /metrics (behind the API tokens when the gateway has them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specwire_gateway_requests", "HTTP requests, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("specwire_gateway_response_seconds", "Time to the response's headers: the whole "
                                 "answer when unstreamed, the first chunk when streamed", ["endpoint"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        # What routers read to pick a gateway, named as vLLM's (vllm:num_requests_waiting, ...) under the prefix
        # the verifier uses, so that an endpoint picker reads them the same way. The gateway has no admission
        # limit or queue of its own: waiting is what it has accepted and not yet begun to answer.
        self.requests_waiting = Gauge("specwire:num_requests_waiting", "Generation requests accepted (valid, "
                                      "model known) whose first token has not arrived: chat templates rendering "
                                      "and requests at the draft service before their first token (the gateway "
                                      "has no queue of its own)", registry=self.registry)
        self.requests_running = Gauge("specwire:num_requests_running", "Generation requests past their first "
                                      "token that the gateway is still generating or streaming", registry=self.registry)

    def in_flight(self) -> InFlight:
        return InFlight(self)


class InFlight:
    """One generation request in the gauges: waiting from when it is accepted until its first token, then running
    until `finish`. Both steps are idempotent, so every path that ends a request (answer, error, a client gone, a
    stream closed or never read) may call `finish` and the gauges count it once."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._state = "waiting"
        metrics.requests_waiting.inc()

    def started(self) -> None:
        if self._state == "waiting":
            self._metrics.requests_waiting.dec()
            self._metrics.requests_running.inc()
            self._state = "running"

    def finish(self) -> None:
        if self._state == "waiting":
            self._metrics.requests_waiting.dec()
        elif self._state == "running":
            self._metrics.requests_running.dec()
        self._state = "done"


class CountRequests:
    """ASGI middleware: counts each HTTP response by endpoint and status when its headers go out."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        t0 = time.perf_counter()

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
                self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, counted)


def create_app(config: GatewayConfig, *, chat: ChatTemplate | None = None,
               connect_client: Callable[[GatewayConfig], AsyncClient] = connect) -> FastAPI:
    """The app; `connect_client` makes the draft service's client when the app starts serving (tests give a
    fake)."""
    name = model_name(config)
    chat = chat if chat is not None else ChatTemplate.load(config.tokenizer)
    tokens = TokenFile(config.auth_token_file) if config.auth_token_file else None
    created = int(time.time())
    state: dict[str, AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["client"] = connect_client(config)  # grpc.aio channels belong to the serving loop
        log.info("gateway_ready", server=config.server, model=name, chat_template=chat.tokenizer is not None,
                 tokens_required=tokens is not None)
        yield
        await state["client"].close()
        chat.close()

    app = FastAPI(title="specwire gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics = GatewayMetrics()
    # NOTE: a plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware re-wraps streamed
    # bodies, and a client's disconnect then no longer cancels its generation (tests/test_gateway.py caught it).
    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":  # its loc is a position in the text, not a field
            message, where = "the request body is not valid JSON", ""
        body = ApiError(400, f"{where}: {message}" if where else message, param=where or None).body()
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        # NOTE: the last resort, in OpenAI's shape: a bug, not the caller's fault (never its input's, which the
        # request models and `check` refuse with 400s)
        log.error("gateway_internal_error", path=request.url.path, error=repr(err)[:500])
        return JSONResponse(ApiError(500, "internal error in the gateway", type="server_error").body(),
                            status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = ApiError(err.status_code, str(err.detail), type=_HTTP_ERRORS.get(err.status_code, "server_error")).body()
        return JSONResponse(body, status_code=err.status_code)

    def authorize(request: Request) -> None:
        if tokens is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not tokens.accepts(presented.strip().encode()):
            log.info("gateway_unauthenticated", path=request.url.path)  # never the token
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <token>",
                           type="authentication_error", code="invalid_api_key")

    def check_model(requested: str) -> None:
        if requested != name:
            raise ApiError(404, f"the model {requested!r} does not exist; this gateway serves {name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "specwire"}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the draft service serves and is connected to its verifier; 503 otherwise."""
        try:
            draft = await state["client"].health(timeout=HEALTH_TIMEOUT_S)
            verifier = await state["client"].health("specwire.v1.Draft", timeout=HEALTH_TIMEOUT_S)
        except SpecwireError as err:
            return JSONResponse({"status": "unavailable", "draft": "UNREACHABLE", "detail": err.message},
                                status_code=503)
        ok = draft == verifier == "SERVING"
        body = {"status": "ok" if ok else "unavailable", "draft": draft,
                "verifier": "CONNECTED" if verifier == "SERVING" else "DISCONNECTED"}
        return JSONResponse(body, status_code=200 if ok else 503)

    # NOTE: behind the API tokens, not on a port of its own: the gateway is the public face, its metrics tell who
    # sends how much, and one port keeps one TLS and token setup (Prometheus sends the token from
    # `authorization: {credentials_file: ...}`). Without --auth-token-file every route is open, this one too.
    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check()
        prompt = body.prompt_kwargs()
        kwargs = {**prompt, **body.generate_kwargs(body.max_new_tokens())}
        return await _respond(request, body, kwargs, "cmpl", "text_completion", _completion_choice,
                              metrics.in_flight())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check()
        flight = metrics.in_flight()  # the template renders one conversation at a time: a queue of the gateway's
        try:
            kwargs = {"prompt_token_ids": await chat.render(body.template_messages()),
                      **body.generate_kwargs(body.max_new_tokens())}
        except BaseException:
            flight.finish()
            raise
        return await _respond(request, body, kwargs, "chatcmpl", "chat.completion", _chat_choice, flight)

    async def _respond(request: Request, body, kwargs: dict, prefix: str, kind: str, choice,
                       flight: InFlight) -> Response:
        """The answer; `flight` ends here, or, for a stream, when its response has been sent or abandoned."""
        client = state["client"]
        rid, t0 = new_id(prefix), time.perf_counter()
        if body.stream:
            result = Result()
            try:
                chunks = client.stream(**kwargs, result=result)
                try:  # the first chunk before the headers: a request the services refuse gets its own status
                    first = await anext(chunks)
                except StopAsyncIteration:
                    first = None
                except SpecwireError as err:
                    raise from_grpc(err.code, err.message) from None
            except BaseException:
                flight.finish()
                raise
            flight.started()
            events = _stream(body, chunks, first, result, rid, kind, choice)
            return _EventStream(_sse(events, rid, t0), flight, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            result = await _unless_disconnected(request, _collect(client, kwargs, flight))
        except SpecwireError as err:
            raise from_grpc(err.code, err.message) from None
        finally:
            flight.finish()
        if result is None:  # the client went away; the generation was cancelled
            log.info("gateway_request", id=rid, outcome="disconnected")
            return Response(status_code=499)
        out = {"id": rid, "object": kind, "created": now(), "model": name,
               "choices": [choice(result.text, finish_reason(result), final=True)], "usage": usage(result)}
        if body.specwire_stats:
            out["specwire_stats"] = stats_extension(result.stats)
        log.info("gateway_request", id=rid, outcome="ok", tokens=len(result.token_ids),
                 wall_s=round(time.perf_counter() - t0, 4))
        return JSONResponse(out, headers={"X-Request-Id": rid})

    async def _stream(body, chunks: AsyncIterator[Chunk], first: Chunk | None, result: Result, rid: str, kind: str,
                      choice) -> AsyncIterator[dict]:
        chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
        head = {"id": rid, "object": chunk_kind, "created": now(), "model": name}
        extra = {"usage": None} if body.include_usage else {}
        if kind == "chat.completion":  # OpenAI's first chat chunk names the role
            yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
        try:
            if first is not None and first.text:
                yield {**head, "choices": [choice(first.text, None, final=False)], **extra}
            async for chunk in chunks:
                if chunk.text:
                    yield {**head, "choices": [choice(chunk.text, None, final=False)], **extra}
        finally:
            await chunks.aclose()  # also when the client went away: cancels the generation
        last = {**head, "choices": [choice("", finish_reason(result), final=False)], **extra}
        if body.specwire_stats:
            last["specwire_stats"] = stats_extension(result.stats)
        yield last
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage(result)}

    return app


class _EventStream(StreamingResponse):
    """A streamed answer that ends its request in the gauges however the response ends: sent, an error, or the
    client gone (an http.disconnect under ASGI 2.3, or an OSError from send under 2.4, which leaves the body
    iterator suspended until the loop finalizes it)."""

    def __init__(self, content: AsyncIterator[str], flight: InFlight, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._flight = flight

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._flight.finish()


async def _collect(client: AsyncClient, kwargs: dict, flight: InFlight) -> Result:
    """An unstreamed generation (as the SDK's generate() does it), telling `flight` when the first token came."""
    result = Result()
    async for _ in client.stream(**kwargs, result=result):
        flight.started()
    return result


def _completion_choice(text: str, reason: str | None, *, final: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def _chat_choice(text: str, reason: str | None, *, final: bool) -> dict:
    if final:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}
    return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}


async def _sse(events: AsyncIterator[dict], rid: str, t0: float) -> AsyncIterator[str]:
    """Server-sent events. An error after the headers went out is sent as an error event (the status is already
    200), then the stream ends; a client that goes away cancels this generator and with it the generation."""
    outcome = "ok"
    try:
        async for payload in events:
            yield f"data: {json.dumps(payload)}\n\n"
    except SpecwireError as err:
        outcome = "error"
        yield _sse_error(from_grpc(err.code, err.message))
    except asyncio.CancelledError:
        log.info("gateway_request", id=rid, outcome="disconnected", stream=True)
        raise
    yield "data: [DONE]\n\n"
    log.info("gateway_request", id=rid, outcome=outcome, stream=True, wall_s=round(time.perf_counter() - t0, 4))


def _sse_error(err: ApiError) -> str:
    """An error after the headers, as an SSE message every client we know reads as a failure: the `data` line is
    vLLM's and OpenAI's error object (the openai package and guidellm raise on it), the `event: error` field and
    the comment with the message are what aiperf looks for (without them it counted a broken stream as a success
    with fewer tokens). Clients that know neither skip the `event` and comment lines, as SSE says."""
    message = " ".join(err.message.splitlines())
    return f"event: error\n: {message}\ndata: {json.dumps(err.body())}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Result]) -> Result | None:
    """The result, or None (the work cancelled) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()

