"""The gRPC server both services run: grpc.aio with health checking, reflection (can be switched off), TLS or
mutual TLS and bearer tokens when configured, served until SIGINT or SIGTERM, then shut down gracefully (health
says NOT_SERVING first, then in-flight calls get a grace period)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import ServerSecurityConfig
from common.security import BearerTokenInterceptor, TokenFile, server_credentials

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_S = 2.0


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    port: int  # the bound port (the one asked for, or the one the OS chose for 0)

    async def start(self) -> None:
        await self.server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Health NOT_SERVING, no new call taken (clients are sent GOAWAY and go elsewhere), calls in flight get
        `grace_s` to finish, then are cancelled."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)


class _Undecodable:
    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse (invalid UTF-8 in a string field, truncated bytes) gets INVALID_ARGUMENT
    with protobuf's reason, instead of grpc's UNKNOWN. Unary-request methods; a stream's undecodable message
    ends the stream in grpc itself."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
                return _Undecodable(err)

        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def refuse(context, request) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{details.method}: the request does not parse: {request.error}")

        if handler.response_streaming:
            async def behaviour(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                async for item in inner(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(behaviour, request_deserializer=deserialize,
                                                        response_serializer=handler.response_serializer)

        async def unary(request, context):
            if isinstance(request, _Undecodable):
                await refuse(context, request)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserialize,
                                                   response_serializer=handler.response_serializer)


def write_port_file(path: str | None, port: int) -> None:
    """The bound port's number into `path` (None: nothing), whole or not at all: a reader polling for the file
    never sees it half written."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def _log_refused(method: str, reason: str) -> None:
    log.warning("call_unauthenticated", method=method, reason=reason)  # the reason never quotes a token


def build_grpc_server(host: str, port: int, *, add_servicers: Callable[[grpc.aio.Server], None],
                      service_names: Sequence[str], options: Sequence[tuple[str, int]],
                      security: ServerSecurityConfig | None = None) -> GrpcServer:
    """A bound, not yet started server with the servicers `add_servicers` registers, health and reflection."""
    security = security or ServerSecurityConfig()
    security.check_security()
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if security.auth_token_file:  # first: a call without a token learns nothing else
        interceptors.append(BearerTokenInterceptor(TokenFile(security.auth_token_file), on_refused=_log_refused))
    interceptors.append(DecodeErrorInterceptor())
    server = grpc.aio.server(options=list(options), interceptors=interceptors)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    credentials = server_credentials(security.tls_cert, security.tls_key, security.tls_client_ca)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as err:  # grpc's "Failed to bind to address": in use, or not an address of this host
        raise OSError(f"cannot bind {address} (is another service listening there?): {err}") from err
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return GrpcServer(server, health_servicer, tuple(service_names), bound)


async def serve_until_stopped(server: GrpcServer, *, on_stop: Callable[[], Awaitable[None]] | None = None,
                             stop: asyncio.Event | None = None,
                             drain: Callable[[], Awaitable[None]] | None = None,
                             grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Run until SIGINT or SIGTERM, then `drain` (while the server still serves), stop the server and call
    `on_stop` for the service's own parts (calls in flight get `grace_s` to finish). With `stop`, run until it is set instead, and leave the process's
    signals alone: a service embedded in another program (the test suite runs services on threads of its own
    process) is stopped by its host."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        try:
            if drain is not None:
                await drain()
        finally:
            await server.stop(grace_s)
        if on_stop is not None:
            await on_stop()
