"""The gateway's Prometheus metrics: requests by endpoint and status, response times, and the queue gauges routers
read (specwire:num_requests_waiting and specwire:num_requests_running), with the ASGI middleware that counts."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


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
