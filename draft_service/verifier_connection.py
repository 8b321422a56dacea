"""The connection half of the draft's Verify stream: connect (GetInfo, then the hello/welcome handshake), carry
messages both ways, and reconnect when the stream breaks, with exponential backoff and jitter, on a fresh
channel each attempt (so gRPC's own reconnect backoff never delays noticing that the verifier is back).

It knows nothing of sequences: what arrives goes to `on_message`, and a broken stream to `on_lost`
(draft_service/verifier_link.py routes both to the sequences).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import grpc
import structlog

from common.errors import ErrorCode, ServiceError
from common.security import read_token, tls_name_override, token_metadata
from draft_service.link_security import LinkSecurity
from draft_service.types import VerifierIdentity
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire

log = structlog.get_logger(__name__)

ATTEMPT_TIMEOUT_S = 5.0  # one connection attempt: GetInfo, then the hello/welcome handshake
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
# Errors no retry can fix: the attempt's error is reported at once to whoever waits with fail_fast.
PERMANENT_ERRORS = (ErrorCode.FAILED_PRECONDITION, ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)


class LinkDown(Exception):
    """A message could not be sent: the stream is down (the caller resumes, as for StreamLost)."""


class VerifierConnection:
    def __init__(self, target: str, hello: verifier_pb2.Hello, *, security: LinkSecurity,
                 on_message: Callable[[verifier_pb2.VerifierMessage], None], on_lost: Callable[[str], None],
                 on_reconnect: Callable[[], None] | None = None) -> None:
        """`hello` with vocab_size 0: a proposer without logits takes the verifier's. `on_lost(reason)`: the stream
        ended, whatever ended it (the verifier, the network, or a teardown here: every live sequence must be
        resumed on the next one). `on_reconnect`: after each successful reconnection (not the first
        connection)."""
        self.target = target
        self._hello = hello
        self._security = security
        self._token = security.token
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_reconnect = on_reconnect
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._reconnect_task: asyncio.Task | None = None
        self._attempted = asyncio.Event()  # set (and replaced) after every connection attempt
        self._last_error: ServiceError | None = None
        self._closed = False
        self.num_connections = 0  # streams opened so far: the current one's number
        self.identity: VerifierIdentity | None = None

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def ensure_connected(self, timeout_s: float, *, fail_fast: bool = True) -> VerifierIdentity:
        """The verifier's identity once the stream is up; starts (re)connecting if it is not. Raises
        ServiceError: UNAVAILABLE after timeout_s, or at once, with fail_fast, an error no retry can fix (a
        handshake mismatch, a refused token)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            error = self._last_error
            if fail_fast and error is not None and error.code in PERMANENT_ERRORS:
                raise error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f": {error.message}" if error is not None else ""
                code = error.code if error is not None and error.code in PERMANENT_ERRORS else ErrorCode.UNAVAILABLE
                raise ServiceError(code, f"the verifier at {self.target} was not reachable within "
                                   f"{timeout_s:g}s{detail}")
            self.start_reconnecting()
            attempted = self._attempted
            try:
                await asyncio.wait_for(attempted.wait(), remaining)
            except TimeoutError:
                pass
        return self.identity

    def start_reconnecting(self) -> None:
        if self._closed:
            raise ServiceError(ErrorCode.UNAVAILABLE, "the draft service is shutting down")
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.create_task(self._reconnect(), name="verifier-link-reconnect")

    def send(self, msg: verifier_pb2.DraftMessage) -> None:
        if not self.connected:
            raise LinkDown(f"the Verify stream to {self.target} is down")
        self._outbox.put_nowait(msg)

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            await asyncio.gather(self._reconnect_task, return_exceptions=True)
        await self._teardown()

    @property
    def last_error(self) -> ServiceError | None:
        """Why the last connection attempt failed (None once one succeeded)."""
        return self._last_error

    @property
    def closed(self) -> bool:
        return self._closed

    # -- connecting -------------------------------------------------------------------------------------------

    async def _reconnect(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._closed and not self.connected:
            try:
                await self._connect_once()
                self._last_error = None
            except ServiceError as err:
                self._last_error = err
                log.warning("verifier_connect_failed", target=self.target, code=err.code.name, message=err.message,
                            retry_in_s=round(delay, 3))
            self._attempted.set()
            self._attempted = asyncio.Event()
            if self.connected:
                return
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # jitter: drafts do not retry in lockstep
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect_once(self) -> None:
        """GetInfo, then the hello/welcome handshake, on a fresh channel."""
        await self._teardown()
        options = [*wire.CHANNEL_OPTIONS, *tls_name_override(self._security.server_name)]
        if self._security.credentials is not None:
            self._channel = grpc.aio.secure_channel(self.target, self._security.credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        stub = verifier_pb2_grpc.VerifierStub(self._channel)
        metadata = self._attempt_metadata()
        try:
            info = await stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=ATTEMPT_TIMEOUT_S, metadata=metadata)
            self._check_identity(info)
            self._call = stub.Verify(metadata=metadata)
            await self._call.write(verifier_pb2.DraftMessage(hello=self._hello))
            first = await asyncio.wait_for(self._call.read(), ATTEMPT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            await self._teardown()
            raise ServiceError(wire.error_code_from_status_name(err.code().name),
                               f"verifier {self.target}: {err.details()}") from err
        except TimeoutError as err:
            await self._teardown()
            raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self.target} did not answer the handshake "
                               f"within {ATTEMPT_TIMEOUT_S:g}s") from err
        except ServiceError:
            await self._teardown()
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
            await self._teardown()
            raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self.target} closed the stream at handshake")
        self._outbox = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_loop(), name="verifier-link-reader")
        self._writer = asyncio.create_task(self._write_loop(), name="verifier-link-writer")
        self.num_connections += 1
        log.info("verifier_connected", target=self.target, model=info.model_id,
                 max_draft_tokens=info.max_draft_tokens, tls=self._security.credentials is not None,
                 reconnect=self.num_connections > 1)
        if self.num_connections > 1 and self._on_reconnect is not None:
            self._on_reconnect()

    def _attempt_metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token for one connection attempt. The token file is read again at each, so a draft whose
        token was rotated (the new one first in its file, the old one then retired on the verifier) reconnects
        with the new one instead of being refused for ever; a read that fails (a file caught mid-rewrite) keeps
        the last good token and logs why."""
        path = self._security.token_file
        if path:
            try:
                self._token = read_token(path)
            except ValueError as err:  # unreadable or no token: the message names the file, never a token
                log.error("verifier_token_file_read_failed", path=path, reason=str(err))
        return token_metadata(self._token)

    def _check_identity(self, info: verifier_pb2.VerifierInfo) -> None:
        if not self._hello.vocab_size:  # a proposer without logits takes the verifier's vocabulary
            self._hello.vocab_size = info.vocab_size
        mismatch = wire.handshake_mismatch(info, self._hello)
        if mismatch is not None:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, mismatch)
        self.identity = VerifierIdentity(info.model_id, info.vocab_size, info.tokenizer_fingerprint,
                                         info.max_draft_tokens, info.max_model_len, tuple(info.features),
                                         model_fingerprint=info.model_fingerprint, dtype=info.dtype,
                                         quantization=info.quantization, max_q_support=max(0, info.max_q_support),
                                         max_tree_nodes=max(0, info.max_tree_nodes) if wire.FEATURE_TREE in info.features
                                         else 0)

    async def _teardown(self) -> None:
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reader = self._writer = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- the stream -------------------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._call.write(msg)

    async def _read_loop(self) -> None:
        reason = "the verifier ended the stream"
        cancelled = False
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    break
                self._on_message(msg)
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            reason, cancelled = "the link was closed", True
            raise
        finally:
            self._on_lost(reason)
            if not cancelled and not self._closed and self._reader is asyncio.current_task():
                self._reader = None  # `connected` turns false at once, not only once this task is done
                asyncio.get_running_loop().call_soon(self.start_reconnecting)
