"""The asyncio side of continuous batching: collects commands from every Verify stream, runs engine steps
back to back in the engine's worker thread while work exists, and routes each outcome to its stream at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

from common.aio import coalesce
from common.compute_thread import compute_thread
from common.errors import ErrorCode, ServiceError
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.phases import PhasePlanner
from verifier_service.stream_outbox import StreamLimits, StreamOutbox, pending_size
from verifier_service.types import (
    CloseStreamCmd,
    Command,
    LoadOut,
    Outcome,
    SeqKey,
    StepResult,
)

log = structlog.get_logger(__name__)


class AsyncEngine:
    def __init__(self, engine: VerifierEngine, metrics: VerifierMetrics,
                 executor: ThreadPoolExecutor | None = None, *, limits: StreamLimits | None = None,
                 phases: str = "hold", whole_batch_goodput: bool = False) -> None:
        """executor: the one thread every step runs on; pass the one that loaded the model (see
        common.compute_thread). phases: when steps start (phases.py): "hold" (one phase, a step waits for the
        sequences answered with it), "split" (and two phases where those are faster), "off" (at once).
        whole_batch_goodput: pass the sequences the plan waits for to each step, whose goodput choice is then
        made for the whole batch (engine._away)."""
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or StreamLimits()
        self._streams: dict[int, StreamOutbox] = {}
        self._stream_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._executor = executor or compute_thread("verifier-engine")
        self._task: asyncio.Task | None = None
        self._held_for_drafts = 0.0  # of the last hold, the seconds it waited for sequences asked to draft
        self._stopping = False
        self.draining = asyncio.Event()  # set once by drain(): no new sequence is admitted
        self._last_step_s = 0.0
        self.whole_batch_goodput = whole_batch_goodput
        scheduler = getattr(engine, "scheduler", None)  # a test's stand-in engine may have none
        self.phases = None if phases == "off" else PhasePlanner(
            split=phases == "split", max_step_tokens=getattr(scheduler, "max_num_batched_tokens", None))
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

    def load(self) -> LoadOut:
        """The load every stream's draft is told of (read on the event loop between steps: counts only)."""
        blocks = self.engine.blocks
        scheduler = getattr(self.engine, "scheduler", None)  # a test's stand-in engine may have none
        return LoadOut(num_running=len(scheduler.running) if scheduler is not None else 0,
                       num_waiting=len(scheduler.waiting) if scheduler is not None else 0,
                       kv_cache_usage=round(blocks.num_used_blocks / max(1, blocks.num_blocks), 3),
                       num_free_blocks=blocks.num_blocks - blocks.num_used_blocks, draining=self.draining.is_set())

    def num_live_sequences(self) -> int:
        scheduler = getattr(self.engine, "scheduler", None)
        return len(scheduler.sequences) if scheduler is not None else 0

    async def drain(self, grace_s: float) -> int:
        """Admit no new sequence (the servicer refuses opens with UNAVAILABLE and every stream is told at once),
        and wait until the live sequences have finished, or for grace_s. Returns how many are left: ending the
        streams then hands them to the drafts, which resume them elsewhere."""
        self.draining.set()
        self.metrics.draining.set(1)
        deadline = time.monotonic() + grace_s
        live = self.num_live_sequences()
        log.info("verifier_draining", live_sequences=live, grace_s=grace_s)
        while live and time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.05)
            live = self.num_live_sequences()
        log.info("verifier_drained", left_to_resume_elsewhere=live)
        return live

    def end_streams(self, message: str) -> None:
        """Ends every Verify stream with UNAVAILABLE: after a drain, what is left resumes elsewhere at once (the
        server's shutdown grace would otherwise let the streams go on; measured: three sequences left after a 0.3 s
        drain finished here during the 2 s grace instead)."""
        for out in list(self._streams.values()):
            out.fail(ServiceError(ErrorCode.UNAVAILABLE, message))

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

    async def run_step(self, max_verifications: int | None = None,
                       awaited: frozenset[SeqKey] | None = None, held_s: float = 0.0) -> StepResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.engine.step, max_verifications, awaited, held_s)

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

    async def _plan_step(self) -> tuple[float, int | None, frozenset[SeqKey] | None]:
        """Before a step: plan the phases, then wait while PhasePlanner finds it worth waiting for the proposals
        on their way (each arrival decides again), when there is work to step. Returns the seconds held, the cap
        on the step's verifications and the sequences the plan waits for that are still away (None: no plan). A
        failure turns the plan off: the steps go on, unplanned."""
        try:
            held, cap = await self._planned_hold()
            whole = self.whole_batch_goodput and self.phases is not None
            return held, cap, self.phases.awaited_keys() if whole else None
        except Exception:  # noqa: BLE001 - a bug in the plan must not stop the steps
            log.exception("phase_plan_failed")
            self.phases = None
            return 0.0, None, None

    async def _planned_hold(self) -> tuple[float, int | None]:
        planner = self.phases
        self._held_for_drafts = 0.0
        if planner is None or not (planner.num_present or self.engine.has_runnable_work()):
            return 0.0, None
        started = time.monotonic()
        planner.plan_phases(started)
        drafting = planner.awaits_drafting()
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
        self._held_for_drafts = held if drafting else 0.0
        return held, planner.max_verifications()

    async def _run(self) -> None:
        while not self._stopping:
            await self._wait_for_work()
            # proposals sent in the same burst join this step: 2 % of the last step's time, at most 2 ms
            await coalesce(min(0.002, 0.02 * self._last_step_s))
            held, cap, awaited = await self._plan_step()
            self._wakeup.clear()
            if self.phases is not None:
                self.phases.step_started()
            try:
                result = await self.run_step(cap, awaited, self._held_for_drafts)
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
                 predicted_goodput=None if s.predicted_goodput is None else round(s.predicted_goodput, 1),
                 predicted_plain_goodput=(None if s.predicted_plain_goodput is None
                                          else round(s.predicted_plain_goodput, 1)),
                 plain_margin_declined=None if s.declined_gain is None else round(s.declined_gain, 3),
                 speculation_arm=s.speculation_arm, folded=s.num_folded or None, plain_from=s.plain_from,
                 **({} if s.priced_wait is None else {
                     "wait_ms": round(s.priced_wait[0] * 1e3, 1),
                     "wait_ms_per_block_token": round(s.priced_wait[1] * 1e3, 1),
                     "wait_ms_per_drafted_token": round(s.priced_wait[2] * 1e3, 2),
                     "plain_wait_ms": None if s.priced_wait[3] is None else round(s.priced_wait[3] * 1e3, 1),
                     "wait_ms_per_catch_up_row": round(s.priced_wait[4] * 1e3, 2)}))
