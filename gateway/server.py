"""`specwire gateway`: the FastAPI app served by uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig


def serve(config: GatewayConfig) -> None:
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False,
                ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key, timeout_graceful_shutdown=5)
