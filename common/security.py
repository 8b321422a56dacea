"""Channel security for both services and their clients: TLS and mutual TLS credentials, and bearer tokens.

Tokens travel as gRPC metadata `authorization: Bearer <token>` on every call. A server that has a token file
refuses any call without a listed token with UNAUTHENTICATED before its handler runs; health checks stay open
for probes. Tokens are compared in constant time and never logged. The file holds one token per line (blank
lines and `#` comments ignored), so a new token can be added, rolled out to clients and the old one removed; the
file is re-read when it changes, without a restart. A client sends the first token line. A re-read that finds no
token, or a line that does not parse, keeps the last good set and logs an error: a file caught half-written
never locks everyone out. Replace the file by atomic rename (write a temporary file beside it, then `mv`).

No torch or structlog import at module level: the SDK, installed without the server extra, uses the client half.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Awaitable, Callable

import grpc

AUTH_METADATA_KEY = "authorization"
_BEARER = "Bearer "
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_RELOAD_CHECK_S = 1.0


def _log():
    import structlog  # the server extra; the SDK's half of this module never logs

    return structlog.get_logger(__name__)


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"cannot read the {what} {path!r}: {err.strerror}") from None


# -- TLS --------------------------------------------------------------------------------------------------------


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (None without a certificate). With `client_ca`, clients must present a
    certificate it signed (mutual TLS)."""
    if not cert:
        return None
    pair = (read_file(key, "TLS key"), read_file(cert, "TLS certificate"))
    ca = read_file(client_ca, "client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(*, root_certificates: bytes | None = None, private_key: bytes | None = None,
                        certificate_chain: bytes | None = None) -> grpc.ChannelCredentials:
    """TLS to a server; with a key and certificate chain, this client also authenticates (mutual TLS).
    root_certificates None: the system's trust store."""
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("a client certificate needs both private_key and certificate_chain")
    return grpc.ssl_channel_credentials(root_certificates=root_certificates, private_key=private_key,
                                        certificate_chain=certificate_chain)


def tls_name_override(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options to check the server's certificate against `server_name` instead of the address's host."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


# -- bearer tokens ----------------------------------------------------------------------------------------------


def token_lines(text: str) -> list[bytes]:
    """The tokens of a token file in file order (blank lines and `#` comments skipped)."""
    tokens = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            if any(c.isspace() for c in line):  # the message names the line, never its text: it may be a secret
                raise ValueError(f"line {number}: a token may not contain whitespace (one token per line)")
            tokens.append(line.encode())
    return tokens


def parse_tokens(text: str) -> frozenset[bytes]:
    return frozenset(token_lines(text))


def read_token(path: str) -> str:
    """A client's token: the first token line of the file. During a rotation the file may list the new token first
    while the servers still accept both."""
    tokens = token_lines(read_file(path, "token file").decode())
    if not tokens:
        raise ValueError(f"the token file {path!r} holds no token")
    return tokens[0].decode()


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, _BEARER + token),) if token else ()


class TokenFile:
    """The accepted tokens. The file is checked at most once a second and re-read when it changed. A re-read that
    fails (unreadable, not UTF-8, a line with whitespace, or no token at all: a file truncated for rewriting) keeps
    the last good set and logs an error once per failure; a failed file is read again at every check until good."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._key: tuple[int, ...] | None = None
        self._next_check = 0.0
        self._failure: str | None = None
        self._tokens: frozenset[bytes] = frozenset()
        try:  # at start a bad file is the caller's error: the service does not start
            self._reload()
        except OSError as err:
            raise ValueError(f"cannot read the token file {path!r}: {err.strerror}") from None

    def _stat_key(self) -> tuple[int, ...]:
        st = os.stat(self.path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read(self) -> frozenset[bytes]:
        try:
            tokens = parse_tokens(read_file(self.path, "token file").decode())
        except UnicodeDecodeError:
            raise ValueError(f"the token file {self.path!r} is not UTF-8 text") from None
        if not tokens:
            raise ValueError(f"the token file {self.path!r} holds no token: every call would be refused")
        return tokens

    def _reload(self) -> None:
        # NOTE: keyed on (device, inode, size, mtime, ctime), not mtime alone: an atomic rename changes the inode,
        # and a rewrite in place usually changes the size even within one coarse mtime tick. The key is committed
        # only after a good read that it still describes, so a file caught mid-write is read again next time.
        key = self._stat_key()
        if key == self._key and self._failure is None:
            return
        tokens = self._read()
        if self._stat_key() != key:
            raise ValueError(f"the token file {self.path!r} changed while being read")
        if self._tokens and tokens != self._tokens:
            _log().info("token_file_reloaded", path=self.path, num_tokens=len(tokens))
        self._tokens, self._key = tokens, key

    def tokens(self) -> frozenset[bytes]:
        now = time.monotonic()
        if now >= self._next_check:
            with self._lock:
                self._next_check = now + _RELOAD_CHECK_S
                try:
                    self._reload()
                    self._failure = None
                except (OSError, ValueError) as err:
                    reason = str(err) if isinstance(err, ValueError) else f"cannot read it: {err.strerror}"
                    if reason != self._failure:  # once per failure, not once a second
                        _log().error("token_file_reload_failed", path=self.path, reason=reason,
                                     num_tokens_kept=len(self._tokens))
                    self._failure = reason
        return self._tokens

    def accepts(self, presented: bytes) -> bool:
        # NOTE: compare against every token, whatever matched, so the time taken says nothing of which or how
        # much matched (hmac.compare_digest is constant-time for equal lengths).
        ok = False
        for token in self.tokens():
            ok |= hmac.compare_digest(presented, token)
        return ok


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without reading a request."""

    async def refuse(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without an accepted bearer token, before its handler runs."""

    def __init__(self, tokens: TokenFile, *, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self._tokens = tokens
        self._open_prefixes = open_prefixes
        self._on_refused = on_refused

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._open_prefixes):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA_KEY), None)
        if header is None:
            reason = (f"{details.method} needs a bearer token: send metadata '{AUTH_METADATA_KEY}: Bearer <token>' "
                      "(SDK: token=...; draft service: --verifier-token-file)")
        elif not isinstance(header, str) or not header.startswith(_BEARER):
            reason = f"the '{AUTH_METADATA_KEY}' metadata must read 'Bearer <token>'"
        elif not self._tokens.accepts(header[len(_BEARER):].encode()):
            reason = "the bearer token is not accepted by this server"
        else:
            return handler
        if self._on_refused is not None:
            self._on_refused(details.method, reason)
        return _refusal(handler, reason)
