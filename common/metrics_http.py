"""The Prometheus /metrics endpoint of a service, on a thread of its own, closed with the service."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: Thread

    def close(self) -> None:
        """Stop serving and free the port (a service that stops inside a process that goes on must not leave
        its endpoint answering)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> MetricsServer:
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
