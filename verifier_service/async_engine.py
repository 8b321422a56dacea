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
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.types import CloseStreamCmd, Command, Outcome, StepResult

log = structlog.get_logger(__name__)


class AsyncEngine:
    def __init__(self, engine: VerifierEngine, metrics: VerifierMetrics,
                 executor: ThreadPoolExecutor | None = None) -> None:
        """executor: the one thread every step runs on; pass the one that loaded the model (see
        common.compute_thread)."""
        self.engine = engine
        self.metrics = metrics
        self._streams: dict[int, asyncio.Queue[Outcome]] = {}
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

    def open_stream(self) -> tuple[int, asyncio.Queue[Outcome]]:
        stream_id = next(self._stream_ids)
        out: asyncio.Queue[Outcome] = asyncio.Queue()
        self._streams[stream_id] = out
        self.metrics.streams.set(len(self._streams))
        return stream_id, out

    def close_stream(self, stream_id: int) -> None:
        """Frees every sequence of the stream (a disconnected draft leaks no KV blocks)."""
        self._streams.pop(stream_id, None)
        self.metrics.streams.set(len(self._streams))
        self.metrics.forget_stream(stream_id)
        self.submit(CloseStreamCmd(stream_id))

    def submit(self, command: Command) -> None:
        self.engine.submit(command)
        self._wakeup.set()

    def send(self, outcome: Outcome) -> None:
        out = self._streams.get(outcome.key.stream_id)
        if out is not None:
            out.put_nowait(outcome)

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
            self.metrics.stream_sequences.labels(stream=str(stream_id)).set(engine.scheduler.sequences_on(stream_id))
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
