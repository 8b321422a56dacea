"""The gateway's HTTP routes (FastAPI): OpenAI's completions, chat completions and models, plus /health, in front of
one draft service reached through specwire's async SDK. Streaming is server-sent events; a client that goes away
cancels its generation on both services."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.security import TokenFile, read_file, read_token
from gateway.answers import Answers, chat_choice, completion_choice
from gateway.api_errors import ApiError
from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from gateway.metrics import CountRequests, GatewayMetrics
from gateway.openai_api import ChatCompletionRequest, CompletionRequest
from specwire.client import AsyncClient
from specwire.errors import SpecwireError

log = structlog.get_logger(__name__)

HEALTH_TIMEOUT_S = 2.0
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


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the API's own, request validation (400), HTTP errors, and the last resort."""

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


class Gateway:
    """The routes' state: the model's name, the chat template, the API tokens, and the draft service's client
    (made when the app starts serving: grpc.aio channels belong to the serving loop)."""

    def __init__(self, config: GatewayConfig, chat: ChatTemplate, metrics: GatewayMetrics) -> None:
        self.name = model_name(config)
        self.chat = chat
        self.tokens = TokenFile(config.auth_token_file) if config.auth_token_file else None
        self.created = int(time.time())
        self.metrics = metrics
        self.answers = Answers(self.name)
        self.client: AsyncClient | None = None

    def authorize(self, request: Request) -> None:
        if self.tokens is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not self.tokens.accepts(presented.strip().encode()):
            log.info("gateway_unauthenticated", path=request.url.path)  # never the token
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <token>",
                           type="authentication_error", code="invalid_api_key")

    def check_model(self, requested: str) -> None:
        if requested != self.name:
            raise ApiError(404, f"the model {requested!r} does not exist; this gateway serves {self.name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "specwire"}

    async def health(self) -> JSONResponse:
        """200 while the draft service serves and is connected to its verifier; 503 otherwise."""
        try:
            draft = await self.client.health(timeout=HEALTH_TIMEOUT_S)
            verifier = await self.client.health("specwire.v1.Draft", timeout=HEALTH_TIMEOUT_S)
        except SpecwireError as err:
            return JSONResponse({"status": "unavailable", "draft": "UNREACHABLE", "detail": err.message},
                                status_code=503)
        ok = draft == verifier == "SERVING"
        body = {"status": "ok" if ok else "unavailable", "draft": draft,
                "verifier": "CONNECTED" if verifier == "SERVING" else "DISCONNECTED"}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card()

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        kwargs = {**body.prompt_kwargs(), **body.generate_kwargs(body.max_new_tokens())}
        return await self.answers.respond(self.client, request, body, kwargs, "cmpl", "text_completion",
                                          completion_choice, self.metrics.in_flight())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        flight = self.metrics.in_flight()  # the template renders one conversation at a time: a queue of the gateway's
        try:
            kwargs = {"prompt_token_ids": await self.chat.render(body.template_messages()),
                      **body.generate_kwargs(body.max_new_tokens())}
        except BaseException:
            flight.finish()
            raise
        return await self.answers.respond(self.client, request, body, kwargs, "chatcmpl", "chat.completion",
                                          chat_choice, flight)


def create_app(config: GatewayConfig, *, chat: ChatTemplate | None = None,
               connect_client: Callable[[GatewayConfig], AsyncClient] = connect) -> FastAPI:
    """The app; `connect_client` makes the draft service's client when the app starts serving (tests give a
    fake)."""
    chat = chat if chat is not None else ChatTemplate.load(config.tokenizer)
    metrics = GatewayMetrics()
    gateway = Gateway(config, chat, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        gateway.client = connect_client(config)
        log.info("gateway_ready", server=config.server, model=gateway.name, chat_template=chat.tokenizer is not None,
                 tokens_required=gateway.tokens is not None)
        yield
        await gateway.client.close()
        chat.close()

    app = FastAPI(title="specwire gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    # NOTE: a plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware re-wraps streamed
    # bodies, and a client's disconnect then no longer cancels its generation (tests/test_gateway.py caught it).
    app.add_middleware(CountRequests, metrics=metrics)
    _install_error_handlers(app)
    authorized = [Depends(gateway.authorize)]
    app.get("/health")(gateway.health)
    # NOTE: behind the API tokens, not on a port of its own: the gateway is the public face, its metrics tell who
    # sends how much, and one port keeps one TLS and token setup (Prometheus sends the token from
    # `authorization: {credentials_file: ...}`). Without --auth-token-file every route is open, this one too.
    app.get("/metrics", dependencies=authorized)(gateway.prometheus)
    app.get("/v1/models", dependencies=authorized)(gateway.models)
    app.get("/v1/models/{model_id:path}", dependencies=authorized)(gateway.model)
    app.post("/v1/completions", dependencies=authorized)(gateway.completions)
    app.post("/v1/chat/completions", dependencies=authorized)(gateway.chat_completions)
    return app
