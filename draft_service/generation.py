"""One client request, end to end: draft a block, have the verifier decide it, roll the draft back to what
was verified, stream the verified text; until the verifier ends the sequence or a stop string appears."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog

from common.errors import ErrorCode, SpecwireError, invalid_argument
from common.sampling import FinishReason, count_positions, validate_token_ids
from common.tokenizer import IncrementalDetokenizer
from draft_service.adaptive import AdaptiveDraftLength
from draft_service.config import DraftConfig
from draft_service.metrics import DraftMetrics
from draft_service.ngram import propose_ngram
from draft_service.proposer import DraftSequence, Proposer
from draft_service.stop_strings import StopStringMatcher
from draft_service.types import (
    DraftBlock,
    DroppedEvent,
    ErrorEvent,
    GenerationRequest,
    GenerationStats,
    TextChunk,
)
from draft_service.verifier_link import VerifierLink

log = structlog.get_logger(__name__)


class Generator:
    def __init__(self, config: DraftConfig, tokenizer: Any, vocab_size: int, link: VerifierLink,
                 proposer: Proposer | None, metrics: DraftMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.link = link
        self.proposer = proposer
        self.metrics = metrics or DraftMetrics()

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif req.prompt_text:
            ids = self.tokenizer.encode(req.prompt_text, add_special_tokens=False)
        else:
            raise invalid_argument("prompt is empty: give prompt text or prompt token ids")
        validate_token_ids(ids, self.vocab_size)
        return ids

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        self.metrics.active.inc()
        outcome = "error"
        try:
            async for event in self._generate(req):
                if isinstance(event, GenerationStats):
                    outcome = "ok"
                    self.metrics.observe(event)
                yield event
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.active.dec()
            self.metrics.requests.labels(outcome=outcome).inc()

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        t0 = time.perf_counter()
        prompt = self._prompt_ids(req)
        identity = self.link.identity if self.link.connected else await self.link.connect()
        k = self.config.num_speculative_tokens if req.num_speculative_tokens is None else req.num_speculative_tokens
        if k < 0:
            raise invalid_argument(f"num_speculative_tokens must be >= 0, got {k}")
        if k > identity.max_draft_tokens:
            raise invalid_argument(f"num_speculative_tokens {k} is above the verifier's maximum "
                                   f"{identity.max_draft_tokens}")
        sampling = req.sampling.with_seed()
        ngram = self.config.proposer == "ngram"
        send_q = self.config.wire_mode == "sparse" and not ngram  # n-gram drafts are one-hot
        adaptive = AdaptiveDraftLength(k) if self.config.adaptive_k and k and not ngram else None
        stats = GenerationStats(num_prompt_tokens=len(prompt), num_speculative_tokens=k)
        seq = DraftSequence(sampling, list(prompt))
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(req.stop)
        seq_id = await self.link.open(prompt, sampling)
        structlog.contextvars.bind_contextvars(seq_id=seq_id)
        finished = False
        try:
            while not finished:
                start = len(seq.token_ids)
                t_draft = time.perf_counter()
                k_round = adaptive.next_k() if adaptive else k
                if ngram:
                    block = DraftBlock(tuple(propose_ngram(seq.token_ids, k)), None)
                elif k_round:
                    block = await self.proposer.draft(seq, k_round, self.config.draft_confidence_threshold)
                else:
                    block = DraftBlock((), None)
                t_sent = time.perf_counter()
                stats.draft_time_s += t_sent - t_draft
                self.link.propose(seq_id, start, block, send_q=send_q)
                event = await self.link.next_event(seq_id)
                wait = time.perf_counter() - t_sent
                stats.verify_wait_s += wait
                if isinstance(event, ErrorEvent):
                    finished = True  # the verifier has already freed the sequence
                    raise SpecwireError(event.code, event.message)
                if isinstance(event, DroppedEvent):
                    raise SpecwireError(ErrorCode.INTERNAL, f"verifier dropped a proposal at {event.start_position}; "
                                        f"it has {event.num_verified} verified tokens")
                stats.num_rounds += 1
                stats.verify_time_s += event.step_time_s
                if adaptive:
                    adaptive.observe(len(block.token_ids), event.num_accepted, t_sent - t_draft, wait)
                stats.num_draft_tokens += len(block.token_ids)
                stats.num_accepted_tokens += event.num_accepted
                stats.num_rejected_rounds += event.num_accepted < len(block.token_ids)
                count_positions(stats.drafted_per_position, len(block.token_ids))
                count_positions(stats.accepted_per_position, event.num_accepted)
                seq.token_ids.extend(event.token_ids)
                stats.num_generated_tokens += len(event.token_ids)
                if stats.num_rounds == 1:
                    stats.time_to_first_token_s = time.perf_counter() - t0
                finished = event.finish_reason is not None
                text, stopped = stops.feed(detok.add(list(event.token_ids), final=finished), final=finished)
                if stopped:
                    finished = True
                    stats.finish_reason = FinishReason.STOP
                    self.link.release(seq_id, cancel=True)
                else:
                    stats.finish_reason = event.finish_reason
                yield TextChunk(event.token_ids, text)
        finally:
            if not finished:  # cancelled by the client or failed here: free it on the verifier
                self.link.release(seq_id, cancel=True)
            else:
                self.link.release(seq_id, cancel=False)
            if self.proposer is not None:
                await self.proposer.release(seq)
            structlog.contextvars.unbind_contextvars("seq_id")
        stats.wall_time_s = time.perf_counter() - t0
        log.info("generation_done", prompt_tokens=stats.num_prompt_tokens, generated=stats.num_generated_tokens,
                 rounds=stats.num_rounds, drafted=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                 k=k, wall_s=round(stats.wall_time_s, 3), finish=stats.finish_reason and stats.finish_reason.value)
        yield stats
