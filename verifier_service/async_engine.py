"""The asyncio side of continuous batching: collects commands from every Verify stream, runs engine steps
back to back in the engine's worker thread while work exists, and routes each outcome to its stream at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from common.aio import coalesce
from common.compute_thread import compute_thread
from common.errors import ErrorCode, ServiceError
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.phases import PhasePlanner
from verifier_service.types import (
    CloseStreamCmd,
    Command,
    DroppedOut,
    ErrorOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    StepResult,
    VerdictOut,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """What the Verify streams may hold on the asyncio side (the flags of the same names in config.py)."""

    max_streams: int = 256
    max_pending_commands: int = 4096
    max_stream_backlog: int = 65536
    max_protocol_errors: int = 64
    handshake_timeout_s: float = 10.0
    max_pending_tokens: int = 1 << 20

    @classmethod
    def from_config(cls, config) -> StreamLimits:
        return cls(config.max_streams, config.max_pending_commands, config.max_stream_backlog,
                   config.max_protocol_errors, config.handshake_timeout_s, config.max_pending_tokens)


_FAILED = object()  # the outbox's last item once its stream has failed
# Refusals that only a malformed message gets. The others (RESOURCE_EXHAUSTED, NOT_FOUND, DEADLINE_EXCEEDED,
# FAILED_PRECONDITION) come from load or from a sequence's state, which a correct draft meets too.
PROTOCOL_ERROR_CODES = frozenset({ErrorCode.INVALID_ARGUMENT})


def pending_size(command: Command) -> int:
    """What a command holds while it waits for the engine, in token ids (and draft-distribution entries): a
    prompt's tokens, a proposal's drafts, assumed tokens and q entries."""
    if isinstance(command, OpenCmd):
        return len(command.prompt_token_ids)
    if isinstance(command, ProposeCmd):
        return (command.num_draft_tokens + len(command.assumed_token_ids)
                + sum(len(q.token_ids) for q in command.draft_probs or ()))
    return 0


class StreamOutbox:
    """One Verify stream's side of the engine: the replies waiting to be sent, bounded, and the commands read
    but not yet applied, bounded by backpressure (in number and in tokens). A stream past its backlog (its
    draft does not read) or past its protocol errors in a row fails: its replies are dropped, its sequences and
    its --max-streams slot freed at once, and get() raises the failure, which the servicer turns into the RPC's
    status; if the servicer is blocked sending a reply to a peer that does not read, `end_rpc` ends the RPC."""

    def __init__(self, limits: StreamLimits, on_fail) -> None:
        self._limits = limits
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_fail = on_fail
        self._errors_in_a_row = 0
        self.failure: ServiceError | None = None
        self.num_pending = 0  # commands submitted and not yet applied by the engine
        self.num_pending_tokens = 0  # what they hold (pending_size)
        self._pending_sizes: deque[int] = deque()  # per pending command, in order: the engine applies in order
        self._credit = asyncio.Event()
        self._credit.set()
        # Set by the servicer: True while it waits for the peer to take a reply (gRPC flow control), and how to
        # end the RPC then, since it would not see the failure in get() until the peer reads.
        self.writing = False
        self.end_rpc: Callable[[ServiceError], None] | None = None

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

    def refused(self, code: ErrorCode) -> None:
        """A message the stream's side refused with `code`: a protocol error if only a malformed message gets
        that code (PROTOCOL_ERROR_CODES)."""
        if code in PROTOCOL_ERROR_CODES:
            self.protocol_error()

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
        if self.writing and self.end_rpc is not None:
            self.end_rpc(error)

    async def get(self) -> Outcome | None:
        item = await self._queue.get()
        if item is _FAILED:
            raise self.failure
        return item

    def empty(self) -> bool:
        return self._queue.empty()

    # -- backpressure on the commands -------------------------------------------------------------------------

    def submitted(self, size: int = 0) -> None:
        """A command of `size` (pending_size) went to the engine."""
        self.num_pending += 1
        self.num_pending_tokens += size
        self._pending_sizes.append(size)
        if not self._has_room():
            self._credit.clear()

    def applied(self, n: int) -> None:
        """The engine applied this stream's next `n` commands."""
        for _ in range(min(n, len(self._pending_sizes))):
            self.num_pending_tokens -= self._pending_sizes.popleft()
        self.num_pending = max(0, self.num_pending - n)
        if self._has_room() or self.failure is not None:
            self._credit.set()

    @property
    def has_credit(self) -> bool:
        """Whether the stream's next message may be read now."""
        return self._credit.is_set()

    def _has_room(self) -> bool:
        return (self.num_pending < self._limits.max_pending_commands
                and self.num_pending_tokens < self._limits.max_pending_tokens)

    async def wait_for_credit(self) -> None:
        """Until the engine has applied enough of this stream's commands to take another (or it failed): the
        stream is not read meanwhile, so gRPC's flow control holds the draft back. One message is always read
        when nothing is pending, so a prompt larger than --max-pending-tokens still gets in (and is judged)."""
        await self._credit.wait()


class AsyncEngine:
    def __init__(self, engine: VerifierEngine, metrics: VerifierMetrics,
                 executor: ThreadPoolExecutor | None = None, *, limits: StreamLimits | None = None,
                 phases: str = "hold") -> None:
        """executor: the one thread every step runs on; pass the one that loaded the model (see
        common.compute_thread). phases: when steps start (phases.py): "hold" (one phase, a step waits for the
        sequences answered with it), "split" (and two phases where those are faster), "off" (at once)."""
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or StreamLimits()
        self._streams: dict[int, StreamOutbox] = {}
        self._stream_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._executor = executor or compute_thread("verifier-engine")
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._last_step_s = 0.0
        self.phases = None if phases == "off" else PhasePlanner(split=phases == "split")
        metrics.kv_blocks_total.set(engine.blocks.num_blocks)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="verifier-engine-loop")

    async def stop(self) -> None:
        # NOTE: the loop checks this too. Python 3.11's asyncio.wait_for swallows a cancel that arrives as the
        # event it waits for is set (a stream closing as the server stops), and the loop would run on.
        self._stopping = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def open_stream(self) -> tuple[int, StreamOutbox]:
        """Raises ServiceError RESOURCE_EXHAUSTED at --max-streams. A failed stream frees its slot at once."""
        if len(self._streams) >= self.limits.max_streams:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"the verifier already serves "
                               f"{self.limits.max_streams} Verify streams (--max-streams): retry later")
        stream_id = next(self._stream_ids)
        out = StreamOutbox(self.limits, on_fail=lambda: self.close_stream(stream_id))
        self._streams[stream_id] = out
        self.metrics.streams.set(len(self._streams))
        self.metrics.open_stream(stream_id)
        return stream_id, out

    def close_stream(self, stream_id: int) -> None:
        """Frees every sequence of the stream (a disconnected draft leaks no KV blocks) and its slot. Called when
        its RPC ends, and as soon as it fails; the second call does nothing."""
        if self._streams.pop(stream_id, None) is None:
            return
        self.metrics.streams.set(len(self._streams))
        self.metrics.forget_stream(stream_id)
        if self.phases is not None:
            self.phases.stream_closed(stream_id)
        self.engine.submit(CloseStreamCmd(stream_id))
        self._wakeup.set()

    def submit(self, command: Command) -> None:
        """Never blocks; a stream's reader awaits StreamOutbox.wait_for_credit() before it reads the next message.
        A command of a stream that is closed (or failed) is dropped: that stream's CloseStreamCmd went before
        it, so what it opened would never be freed."""
        if isinstance(command, CloseStreamCmd):
            self.close_stream(command.stream_id)
            return
        out = self._streams.get(command.key.stream_id)
        if out is None:
            return
        out.submitted(pending_size(command))
        if self.phases is not None:
            self.phases.submitted(command, time.monotonic())
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

    async def run_step(self, max_verifications: int | None = None) -> StepResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.engine.step, max_verifications)

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

    async def _plan_step(self) -> tuple[float, int | None]:
        """Before a step: plan the phases, then wait while PhasePlanner finds it worth waiting for the proposals
        on their way (each arrival decides again), when there is work to step. Returns the seconds held and the
        cap on the step's verifications. A failure turns the plan off: the steps go on, unplanned."""
        try:
            return await self._planned_hold()
        except Exception:  # noqa: BLE001 - a bug in the plan must not stop the steps
            log.exception("phase_plan_failed")
            self.phases = None
            return 0.0, None

    async def _planned_hold(self) -> tuple[float, int | None]:
        planner = self.phases
        if planner is None or not (planner.num_present or self.engine.has_runnable_work()):
            return 0.0, None
        started = time.monotonic()
        planner.plan_phases(started)
        while not self._stopping:
            now = time.monotonic()
            decision = planner.hold(now, started)
            if decision is None:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), decision.deadline - now)
            except TimeoutError:
                break
        held = time.monotonic() - started
        if held > 0.0005:  # NOTE: below this, the loop's own turn: not a hold
            self.metrics.step_hold_seconds.observe(held)
        return held, planner.max_verifications()

    async def _run(self) -> None:
        while not self._stopping:
            await self._wait_for_work()
            # proposals sent in the same burst join this step: 2 % of the last step's time, at most 2 ms
            await coalesce(min(0.002, 0.02 * self._last_step_s))
            held, cap = await self._plan_step()
            self._wakeup.clear()
            if self.phases is not None:
                self.phases.step_started()
            try:
                result = await self.run_step(cap)
            except Exception:  # a bug in a step must not take the server down silently
                log.exception("engine_step_failed")
                continue
            finally:
                self._credit_applied()
            if result.stats is not None:
                self._last_step_s = result.stats.step_time_s
            for outcome in result.outcomes:
                self.send(outcome)
            self._feed_planner(result)
            self._record(result, held)
            # NOTE: no step is running here, so reading the engine's state from the loop is safe; an empty step
            # would cost a thread hop that a proposal arriving meanwhile has to wait for.
            if self.engine.has_pending_commands() or (result.stats is not None and self.engine.has_runnable_work()):
                self._wakeup.set()

    def _feed_planner(self, result: StepResult) -> None:
        """The step's time and its replies to open streams (a stream closed while the step ran was forgotten).
        A failure turns the plan off: the steps go on, unplanned."""
        if self.phases is None:
            return
        try:
            if result.stats is not None:
                self.phases.stepped(result.stats.num_tokens, result.stats.step_time_s)
            now = time.monotonic()
            for outcome in result.outcomes:
                if outcome.key.stream_id in self._streams:
                    self.phases.replied(outcome, now)
        except Exception:  # noqa: BLE001 - a bug in the plan must not stop the steps
            log.exception("phase_plan_failed")
            self.phases = None

    def _record(self, result: StepResult, held_s: float = 0.0) -> None:
        engine = self.engine
        self.metrics.live_sequences.set(len(engine.scheduler.sequences))
        self.metrics.set_occupancy(len(engine.scheduler.waiting), len(engine.scheduler.running),
                                   engine.blocks.num_used_blocks, engine.blocks.num_blocks)
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
                 kv_blocks_used=engine.blocks.num_used_blocks, held_ms=round(held_s * 1e3, 2),
                 phases=self.phases.plan.num_phases if self.phases and self.phases.plan else None,
                 chosen_draft_tokens=sum(s.chosen_draft_lengths) if s.chosen_draft_lengths else None,
                 predicted_goodput=None if s.predicted_goodput is None else round(s.predicted_goodput, 1))
