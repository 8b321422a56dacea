"""The asyncio side of continuous batching: collects commands from every Verify stream, runs engine steps
back to back in the engine's worker thread while work exists, and routes each outcome to its stream at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from common.aio import coalesce
from common.compute_thread import compute_thread
from common.errors import ErrorCode, ServiceError
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.types import CloseStreamCmd, Command, DroppedOut, ErrorOut, Outcome, StepResult, VerdictOut

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """What the Verify streams may hold on the asyncio side (the flags of the same names in config.py)."""

    max_streams: int = 256
    max_pending_commands: int = 4096
    max_stream_backlog: int = 65536
    max_protocol_errors: int = 64
    handshake_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, config) -> StreamLimits:
        return cls(config.max_streams, config.max_pending_commands, config.max_stream_backlog,
                   config.max_protocol_errors, config.handshake_timeout_s)


_FAILED = object()  # the outbox's last item once its stream has failed


class StreamOutbox:
    """One Verify stream's side of the engine: the replies waiting to be sent, bounded, and the commands read
    but not yet applied, bounded by backpressure. A stream past its backlog (its draft does not read) or past
    its protocol errors in a row fails: its replies are dropped, its sequences freed at once, and get() raises
    the failure, which the servicer turns into the RPC's status."""

    def __init__(self, limits: StreamLimits, on_fail) -> None:
        self._limits = limits
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_fail = on_fail
        self._errors_in_a_row = 0
        self.failure: ServiceError | None = None
        self.num_pending = 0  # commands submitted and not yet applied by the engine
        self._credit = asyncio.Event()
        self._credit.set()

    def put(self, outcome: Outcome | None) -> None:
        """A reply, or None: the draft closed its side. Never blocks."""
        if self.failure is not None:
            return
        if isinstance(outcome, VerdictOut | DroppedOut):
            self._errors_in_a_row = 0
        elif isinstance(outcome, ErrorOut) and outcome.code is ErrorCode.ABORTED:  # a duplicate open
            self.protocol_error()
            if self.failure is not None:
                return
        if outcome is not None and self._queue.qsize() >= self._limits.max_stream_backlog:
            self.fail(ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"{self._limits.max_stream_backlog} replies "
                                   "are waiting to be sent on this stream (--max-stream-backlog): the draft does "
                                   "not read its stream, so it was ended"))
            return
        self._queue.put_nowait(outcome)

    def protocol_error(self) -> None:
        """A message no correct draft sends (malformed, a duplicate open, an invalid proposal): too many in a row,
        with no verdict between, and the stream fails."""
        self._errors_in_a_row += 1
        if self._errors_in_a_row > self._limits.max_protocol_errors:
            self.fail(ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"more than {self._limits.max_protocol_errors} "
                                   "protocol errors in a row with no verdict between (--max-protocol-errors): "
                                   "the stream was ended"))

    def fail(self, error: ServiceError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        log.warning("verify_stream_failed", code=error.code.name, message=error.message)
        while not self._queue.empty():  # nothing more is sent: drop the backlog now
            self._queue.get_nowait()
        self._queue.put_nowait(_FAILED)
        self._credit.set()  # a reader waiting for credit sees the failure
        self._on_fail()

    async def get(self) -> Outcome | None:
        item = await self._queue.get()
        if item is _FAILED:
            raise self.failure
        return item

    def empty(self) -> bool:
        return self._queue.empty()

    # -- backpressure on the commands -------------------------------------------------------------------------

    def submitted(self) -> None:
        self.num_pending += 1
        if self.num_pending >= self._limits.max_pending_commands:
            self._credit.clear()

    def applied(self, n: int) -> None:
        self.num_pending = max(0, self.num_pending - n)
        if self.num_pending < self._limits.max_pending_commands:
            self._credit.set()

    async def wait_for_credit(self) -> None:
        """Until the engine has applied enough of this stream's commands to take another (or it failed): the
        stream is not read meanwhile, so gRPC's flow control holds the draft back."""
        await self._credit.wait()


class AsyncEngine:
    def __init__(self, engine: VerifierEngine, metrics: VerifierMetrics,
                 executor: ThreadPoolExecutor | None = None, *, limits: StreamLimits | None = None) -> None:
        """executor: the one thread every step runs on; pass the one that loaded the model (see
        common.compute_thread)."""
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or StreamLimits()
        self._streams: dict[int, StreamOutbox] = {}
        self._stream_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._executor = executor or compute_thread("verifier-engine")
        self._task: asyncio.Task | None = None
        self._last_step_s = 0.0
        metrics.kv_blocks_total.set(engine.blocks.num_blocks)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="verifier-engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def open_stream(self) -> tuple[int, StreamOutbox]:
        """Raises ServiceError RESOURCE_EXHAUSTED at --max-streams. A failed stream counts until its RPC ends."""
        if len(self._streams) >= self.limits.max_streams:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"the verifier already serves "
                               f"{self.limits.max_streams} Verify streams (--max-streams): retry later")
        stream_id = next(self._stream_ids)
        out = StreamOutbox(self.limits, on_fail=lambda: self.submit(CloseStreamCmd(stream_id)))
        self._streams[stream_id] = out
        self.metrics.streams.set(len(self._streams))
        self.metrics.open_stream(stream_id)
        return stream_id, out

    def close_stream(self, stream_id: int) -> None:
        """Frees every sequence of the stream (a disconnected draft leaks no KV blocks)."""
        self._streams.pop(stream_id, None)
        self.metrics.streams.set(len(self._streams))
        self.metrics.forget_stream(stream_id)
        self.submit(CloseStreamCmd(stream_id))

    def submit(self, command: Command) -> None:
        """Never blocks; a stream's reader awaits StreamOutbox.wait_for_credit() before it reads the next message."""
        if not isinstance(command, CloseStreamCmd) and (out := self._streams.get(command.key.stream_id)):
            out.submitted()
        self.engine.submit(command)
        self._wakeup.set()

    def send(self, outcome: Outcome) -> None:
        out = self._streams.get(outcome.key.stream_id)
        if out is not None:
            out.put(outcome)

    def _credit_applied(self) -> None:
        for stream_id, n in self.engine.take_applied().items():
            if (out := self._streams.get(stream_id)) is not None:
                out.applied(n)

    async def run_step(self) -> StepResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.engine.step)

    async def _wait_for_work(self) -> None:
        """Until something is submitted, or until the next idle sequence is due to time out."""
        deadline = self.engine.next_expiry()
        if deadline is None:
            await self._wakeup.wait()
            return
        try:
            await asyncio.wait_for(self._wakeup.wait(), max(0.0, deadline - time.monotonic()) + 0.01)
        except TimeoutError:
            pass

    async def _run(self) -> None:
        while True:
            await self._wait_for_work()
            # proposals sent in the same burst join this step: 2 % of the last step's time, at most 2 ms
            await coalesce(min(0.002, 0.02 * self._last_step_s))
            self._wakeup.clear()
            try:
                result = await self.run_step()
            except Exception:  # a bug in a step must not take the server down silently
                log.exception("engine_step_failed")
                continue
            finally:
                self._credit_applied()
            if result.stats is not None:
                self._last_step_s = result.stats.step_time_s
            for outcome in result.outcomes:
                self.send(outcome)
            self._record(result)
            # NOTE: no step is running here, so reading the engine's state from the loop is safe; an empty step
            # would cost a thread hop that a proposal arriving meanwhile has to wait for.
            if self.engine.has_pending_commands() or (result.stats is not None and self.engine.has_runnable_work()):
                self._wakeup.set()

    def _record(self, result: StepResult) -> None:
        engine = self.engine
        self.metrics.live_sequences.set(len(engine.scheduler.sequences))
        self.metrics.waiting_sequences.set(len(engine.scheduler.waiting))
        self.metrics.kv_blocks_used.set(engine.blocks.num_used_blocks)
        for stream_id in self._streams:
            self.metrics.set_stream_sequences(stream_id, engine.scheduler.sequences_on(stream_id))
        s = result.stats
        if s is None:
            return
        self.metrics.observe_step(s)
        log.info("verify_step", num_seqs=s.num_seqs, num_tokens=s.num_tokens, prefill_tokens=s.num_prefill_tokens,
                 prefix_hit_tokens=s.num_prefix_hit_tokens, preempted=s.num_preempted,
                 verifications=s.num_verifications, drafted=s.num_draft_tokens, accepted=s.num_accepted_tokens,
                 emitted=s.num_emitted_tokens, forward_ms=round(s.forward_s * 1e3, 2),
                 sample_ms=round(s.sample_s * 1e3, 2), host_ms=round(s.host_s * 1e3, 2),
                 device_ms=None if s.device_s is None else round(s.device_s * 1e3, 2), static=s.static,
                 kv_blocks_used=engine.blocks.num_used_blocks)
