"""structlog set-up shared by the services: JSON lines when stderr is not a TTY, colours when it is.

The stdlib loggers (grpc's, transformers') go through the same processors via ProcessorFormatter.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO", *, json: bool | None = None, service: str | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        shared.insert(1, _add_service(service))
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("transformers", "accelerate", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _add_service(service: str):
    def processor(_logger, _name, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    return processor
