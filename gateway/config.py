"""The gateway's configuration: one frozen dataclass whose fields are also the flags of `specwire gateway`."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import option


@dataclass(frozen=True)
class GatewayConfig:
    server: str = option("127.0.0.1:50052", "the draft service's HOST:PORT, or dns:///NAME:PORT for several (calls go "
                         "round robin over the addresses the name resolves to)")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "HTTP port")
    model_name: str | None = option(None, "the model id clients name (default: the --tokenizer directory's name, "
                                    "else 'specwire')", parse=str)
    tokenizer: str | None = option(None, "HF model directory (or .gguf) whose tokenizer and chat template render "
                                   "chat requests; without it /v1/chat/completions answers 400", parse=str)
    auth_token_file: str | None = option(None, "file of accepted bearer tokens, one per line, re-read when it "
                                         "changes; requests without one get 401, /metrics too (/health stays open)",
                                         parse=str)
    tls_cert: str | None = option(None, "PEM certificate chain: serve HTTPS (with --tls-key)", parse=str)
    tls_key: str | None = option(None, "PEM private key of --tls-cert", parse=str)
    server_token_file: str | None = option(None, "file whose first token is sent to the draft service", parse=str)
    server_ca: str | None = option(None, "PEM CA bundle that signed the draft service's certificate (TLS)",
                                   parse=str)
    server_cert: str | None = option(None, "PEM client certificate for a draft service requiring mutual TLS",
                                     parse=str)
    server_key: str | None = option(None, "PEM private key of --server-cert", parse=str)
    server_tls_name: str | None = option(None, "check the draft service's certificate against this name",
                                         parse=str)
    request_timeout_s: float = option(600.0, "longest a request may run (seconds)", flag="--request-timeout")
    log_level: str = option("INFO", "log level")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("HTTPS needs both --tls-cert and --tls-key")
        if bool(self.server_cert) != bool(self.server_key):
            raise ValueError("a client certificate for the draft service needs --server-cert and --server-key")
        if ":" not in self.server:
            raise ValueError(f"server must be HOST:PORT, got {self.server!r}")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
