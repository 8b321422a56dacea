"""The gRPC server both services run: grpc.aio with health checking and reflection, served until SIGINT or
SIGTERM, then shut down gracefully (health says NOT_SERVING first, then in-flight calls get a grace period)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=SHUTDOWN_GRACE_S)


def build_grpc_server(host: str, port: int, *, add_servicers: Callable[[grpc.aio.Server], None],
                      service_names: Sequence[str], options: Sequence[tuple[str, int]]) -> GrpcServer:
    """A bound, not yet started server with the servicers `add_servicers` registers, health and reflection."""
    server = grpc.aio.server(options=list(options))
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return GrpcServer(server, health_servicer, tuple(service_names), bound)


async def serve_until_signal(server: GrpcServer, *, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run until SIGINT or SIGTERM, then stop the server and call `on_stop` for the service's own parts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await server.stop()
        if on_stop is not None:
            await on_stop()
