"""The client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for a draft service's Generate."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import security
from common.generation_stats import GenerationStats
from common.sampling import WireMode
from specwire.errors import InvalidArgumentError, UnavailableError, from_rpc_error
from specwire.v1 import draft_pb2, draft_pb2_grpc, wire


@dataclass(frozen=True)
class Chunk:
    """What one verification round added to a stream: its token ids and their text. The text can lag the ids
    by a few tokens (text that could still become a stop string, or an incomplete UTF-8 character, is held back
    until it is decided); the concatenated texts of a stream equal the final result's text."""

    token_ids: list[int]
    text: str


# A generation's statistics: the draft service's own definition (finish_reason is a str enum: == "stop" holds).
Stats = GenerationStats


@dataclass
class Result:
    """A whole generation: every token id, the text, and the generation's statistics (`stats`: rounds, drafted
    and accepted tokens, acceptance per position, times, finish reason), which arrive with the last chunk."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: Stats | None = None

    @property
    def finish_reason(self) -> str | None:
        """"stop" (an end-of-sequence token or a stop string) or "length" (`max_tokens` or the context); None
        before the generation ended."""
        return self.stats.finish_reason if self.stats else None


def build_request(prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                  max_tokens: int = wire.DEFAULT_MAX_TOKENS, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                  num_speculative_tokens: int | None = None, ignore_eos: bool = False,
                  wire_mode: str | WireMode | None = None,
                  cache_salt: str | None = None, speculation: str | None = None) -> draft_pb2.GenerateRequest:
    """The request both clients send: its keyword arguments are `stream`'s and `generate`'s, defined here once.

    Give `prompt` (text) or `prompt_token_ids`. `wire_mode` ("sparse", "one-hot" or "coupled") overrides the
    draft service's for this request: "coupled" makes a seeded output the target-alone output for that seed,
    whatever the draft, k or pipelining. `cache_salt` (1 to 256 characters; vLLM's cache_salt) isolates the
    request's prefix cache on the verifier: it shares cached KV blocks only with requests of the same salt, so
    one tenant cannot tell from latency whether another's prompt is cached. Give each tenant its own. `speculation`
    "fixed" drafts `num_speculative_tokens` (or the service's k) every round, whatever the verifier chooses from
    its load; a draft service takes it only when started with --allow-request-fixed (for comparing modes on one
    set of processes, as bench/capacity.py does)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt and prompt_token_ids")
    if max_tokens < 1:  # caught before sending: the service would answer the same
        raise InvalidArgumentError(f"max_tokens must be >= 1, got {max_tokens}")
    sampling = wire.sampling_message(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                     max_tokens=max_tokens, ignore_eos=ignore_eos)
    req = draft_pb2.GenerateRequest(sampling=sampling, stop=list(stop or ()))
    if prompt is not None:
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt_token_ids)
    if num_speculative_tokens is not None:
        req.num_speculative_tokens = num_speculative_tokens
    if wire_mode is not None:
        try:
            req.wire_mode = wire.wire_mode_to_proto(WireMode(wire_mode))
        except ValueError:
            raise InvalidArgumentError(f"wire_mode must be one of {', '.join(m.value for m in WireMode)}, got "
                                       f"{wire_mode!r}") from None
    if speculation is not None:
        if speculation != "fixed":
            raise InvalidArgumentError(f"speculation must be 'fixed' (or None: the service's own), got {speculation!r}")
        req.speculation = draft_pb2.REQUEST_SPECULATION_FIXED
    if cache_salt is not None:  # judged by the service (1 to 256 characters)
        req.cache_salt = cache_salt
    return req


def _takes_request_keywords(method):
    """`method(self, prompt=None, *, result=None, **options)`, whose options are build_request's: its signature
    and help list them, and a call is checked against them when it is made, as Python checks any call (so an
    unknown keyword raises TypeError from `client.stream(...)` itself, not from the first chunk)."""
    own = inspect.signature(method).parameters
    keywords = [p for name, p in inspect.signature(build_request).parameters.items() if name != "prompt"]
    params = [own["self"], own["prompt"], *keywords, *([own["result"]] if "result" in own else [])]
    signature = inspect.Signature(params, return_annotation=inspect.signature(method).return_annotation)

    @functools.wraps(method)
    def checked(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{method.__qualname__}(): {err}") from None
        return method(*args, **kwargs)

    checked.__signature__ = signature
    checked.__doc__ = f"{method.__doc__}\n\n{build_request.__doc__}"
    return checked


class _Accumulator:
    def __init__(self) -> None:
        self.result = Result()

    def add(self, msg: draft_pb2.GenerateResponse) -> Chunk | None:
        if msg.WhichOneof("kind") == "chunk":
            chunk = Chunk(list(msg.chunk.token_ids), msg.chunk.text)
            self.result.token_ids.extend(chunk.token_ids)
            self.result.text += chunk.text
            return chunk
        self.result.stats = wire.stats_from_proto(msg.stats)
        return None


DEFAULT_CONNECT_TIMEOUT_S = 10.0
# NOTE: reachability is probed with a health check (wait_for_ready, bounded by connect_timeout) rather than
# grpc.channel_ready_future, whose connectivity-polling thread raises "Channel closed!" once the channel closes.
_HEALTH_CHECK = health_pb2.HealthCheckRequest(service="")


@dataclass(frozen=True)
class _Connection:
    """What both clients derive from their security arguments."""

    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, str]]
    metadata: tuple[tuple[str, str], ...]


def _connection(token: str | None, root_certificates: bytes | None, private_key: bytes | None,
                certificate_chain: bytes | None, channel_credentials: grpc.ChannelCredentials | None,
                tls_server_name: str | None) -> _Connection:
    if channel_credentials is not None and (root_certificates or private_key or certificate_chain):
        raise ValueError("give channel_credentials or root_certificates/private_key/certificate_chain, not both")
    credentials = channel_credentials
    if credentials is None and (root_certificates or private_key or certificate_chain):
        credentials = security.channel_credentials(root_certificates=root_certificates, private_key=private_key,
                                                   certificate_chain=certificate_chain)
    return _Connection(credentials, security.tls_name_override(tls_server_name), security.token_metadata(token))


def _probe_failed(err: grpc.RpcError, target: str, connect_timeout: float, tls: bool):
    """The error for a failed reachability probe: UnavailableError naming the address when nothing answered.
    A TLS handshake that fails looks the same from here (the channel never connects), so with TLS the message
    names the certificate checks too; without TLS, a server that wants it."""
    if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        hint = ("with TLS on, also that the server's certificate names the host you dial (or pass "
                "tls_server_name) and is signed by the CA you trust" if tls else
                "a server started with --tls-cert needs TLS from the client (root_certificates)")
        return UnavailableError(f"no draft service answered at {target} within {connect_timeout:g}s: check the "
                                f"address, that the service is up (raise connect_timeout to wait longer), and, "
                                f"{hint}")
    return from_rpc_error(err)


class _ClientBase:
    """The channel, stubs and settings both clients share; `_aio` picks grpc's asyncio channel."""

    _aio = False

    def __init__(self, target: str, *, timeout: float | None = None,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S, token: str | None = None,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, channel_credentials: grpc.ChannelCredentials | None = None,
                 tls_server_name: str | None = None) -> None:
        self._target = target
        conn = _connection(token, root_certificates, private_key, certificate_chain, channel_credentials,
                           tls_server_name)
        if target.startswith("dns:"):  # a name for several draft services (a headless Service): calls spread
            conn = dataclasses.replace(conn, options=[*conn.options, ("grpc.lb_policy_name", "round_robin")])
        self._tls = conn.credentials is not None
        self._metadata = conn.metadata
        channels = grpc.aio if self._aio else grpc
        self._channel = (channels.secure_channel(target, conn.credentials, options=conn.options) if conn.credentials
                         else channels.insecure_channel(target, options=conn.options))
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout
        self._connect_timeout = connect_timeout


class Client(_ClientBase):
    """Blocking client of a draft service. `target` is HOST:PORT.

    `timeout`: a deadline for each whole call (None: none); it also bounds the sequence on the verifier.
    `connect_timeout`: how long a call waits for the service to be reachable before it fails with
    UnavailableError naming the address (None: wait forever). Breaking out of `stream()` (or closing it) cancels
    the generation on both services.

    Security, in grpc's own terms: `root_certificates` (PEM bytes) turns on TLS and names the CA to trust
    (grpc.ssl_channel_credentials semantics); `private_key` and `certificate_chain` add a client certificate
    (mutual TLS); or pass ready `channel_credentials`. `token` is sent as `authorization: Bearer <token>` on
    every call; a refused one raises UnauthenticatedError. `tls_server_name` checks the certificate against
    that name instead of the target's host."""

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_connected(self) -> None:
        if self._connect_timeout is None:
            return
        try:
            self._health.Check(_HEALTH_CHECK, timeout=self._connect_timeout, wait_for_ready=True,
                               metadata=self._metadata)
        except grpc.RpcError as err:
            raise _probe_failed(err, self._target, self._connect_timeout, self._tls) from None

    def _responses(self, req: draft_pb2.GenerateRequest) -> Iterator[draft_pb2.GenerateResponse]:
        self._wait_connected()
        call = self._stub.Generate(req, timeout=self._timeout, wait_for_ready=True, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # a no-op when the call has ended; frees the generation when the caller stopped early

    @_takes_request_keywords
    def stream(self, prompt: str | None = None, *, result: Result | None = None, **options) -> Iterator[Chunk]:
        """Yield chunks as they are verified; pass `result` to receive the totals and stats at the end."""
        acc = _Accumulator()
        if result is not None:
            acc.result = result
        req = build_request(prompt, **options)
        for msg in self._responses(req):
            chunk = acc.add(msg)
            if chunk is not None:
                yield chunk

    @_takes_request_keywords
    def generate(self, prompt: str | None = None, **options) -> Result:
        """The whole generation at once: its tokens, text and stats."""
        result = Result()
        for _ in self.stream(prompt, result=result, **options):
            pass
        return result


class AsyncClient(_ClientBase):
    """asyncio client of a draft service, with Client's arguments and behaviour."""

    _aio = True

    async def _wait_connected(self) -> None:
        if self._connect_timeout is None:
            return
        try:
            await self._health.Check(_HEALTH_CHECK, timeout=self._connect_timeout, wait_for_ready=True,
                                     metadata=self._metadata)
        except grpc.RpcError as err:
            raise _probe_failed(err, self._target, self._connect_timeout, self._tls) from None

    async def close(self) -> None:
        await self._channel.close()

    async def health(self, service: str = "", *, timeout: float = 5.0) -> str:
        """The draft service's health status name (SERVING, NOT_SERVING, ...). `service` "" is the process;
        "specwire.v1.Draft" is SERVING only while its verifier is connected. UnavailableError when nothing answers
        within `timeout`."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as err:
            raise _probe_failed(err, self._target, timeout, self._tls) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @_takes_request_keywords
    async def stream(self, prompt: str | None = None, *, result: Result | None = None,
                     **options) -> AsyncIterator[Chunk]:
        """Yield chunks as they are verified; pass `result` to receive the totals and stats at the end."""
        acc = _Accumulator()
        if result is not None:
            acc.result = result
        req = build_request(prompt, **options)
        await self._wait_connected()
        call = self._stub.Generate(req, timeout=self._timeout, wait_for_ready=True, metadata=self._metadata)
        try:
            async for msg in call:
                chunk = acc.add(msg)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # breaking out of the loop and closing the generator ends the generation

    @_takes_request_keywords
    async def generate(self, prompt: str | None = None, **options) -> Result:
        """The whole generation at once: its tokens, text and stats."""
        result = Result()
        async for _ in self.stream(prompt, result=result, **options):
            pass
        return result
