"""The gRPC edge of the draft service: GenerateRequest -> GenerationRequest, events -> GenerateResponse."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from common.errors import ServiceError, invalid_argument
from common.tokenizer import INLINE_PROMPT_IDS
from draft_service.generation import Generator
from draft_service.types import GenerationRequest, TextChunk
from specwire.v1 import draft_pb2, draft_pb2_grpc, wire

log = structlog.get_logger(__name__)


def request_from_proto(msg: draft_pb2.GenerateRequest, deadline: float | None = None) -> GenerationRequest:
    sampling = wire.sampling_from_proto(msg.sampling, wire.wire_mode_from_proto(msg.wire_mode))
    kind = msg.WhichOneof("prompt")
    return GenerationRequest(
        prompt_text=msg.text if kind == "text" else None,
        prompt_token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        sampling=sampling,
        stop=tuple(msg.stop),
        num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
        deadline=deadline,
        cache_salt=wire.cache_salt_from_proto(msg),
        fixed_k=_fixed_k(msg.speculation),
    )


def _fixed_k(value: int) -> bool:
    """GenerateRequest.speculation: FIXED, or unset (the service's own mode). An unknown value is INVALID_ARGUMENT,
    as for wire_mode: a silent fallback to the service's mode would run a request as it did not ask."""
    if value not in (draft_pb2.REQUEST_SPECULATION_UNSPECIFIED, draft_pb2.REQUEST_SPECULATION_FIXED):
        raise invalid_argument(f"unknown speculation {value}; this service knows FIXED (or unset for its own mode)")
    return value == draft_pb2.REQUEST_SPECULATION_FIXED


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, generator: Generator) -> None:
        self._generator = generator

    async def Generate(self, request: draft_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        # NOTE: the generation runs in its own task and hands events over a queue, so drafting the next round
        # does not wait for the client's copy of the last chunk to be written.
        events: asyncio.Queue = asyncio.Queue()

        async def produce() -> None:
            try:
                try:
                    remaining = context.time_remaining()  # the client's deadline travels on to the verifier
                    deadline = None if remaining is None else time.monotonic() + remaining
                    num_ids = len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else 0
                    # NOTE: an over-long id list is refused by its length, and a long one converted on a thread: a
                    # 60 MB message holds some 12M ids, seconds of the event loop that serves every stream
                    self._generator.check_num_prompt_ids(num_ids)
                    req = await self._generator.prompts.call(request_from_proto, request, deadline,
                                                             inline=num_ids <= INLINE_PROMPT_IDS)
                except ServiceError:
                    self._generator.metrics.requests.labels(outcome="error").inc()
                    raise
                async for event in self._generator.generate(req):
                    events.put_nowait(event)
                events.put_nowait(None)
            except Exception as err:  # noqa: BLE001 - handed to the consumer, which reports it
                events.put_nowait(err)

        task = asyncio.create_task(produce())
        try:
            while (event := await events.get()) is not None:
                if isinstance(event, ServiceError):
                    log.info("generate_refused", code=event.code.name, message=event.message)
                    await context.abort(grpc.StatusCode[event.code.name], event.message)
                if isinstance(event, Exception):  # a bug: say so, as INTERNAL, and keep serving
                    log.error("generate_failed", exc_info=event)
                    await context.abort(grpc.StatusCode.INTERNAL, f"the draft service failed: "
                                        f"{type(event).__name__}: {event}")
                if isinstance(event, TextChunk):
                    yield draft_pb2.GenerateResponse(chunk=draft_pb2.Chunk(token_ids=event.token_ids, text=event.text))
                else:
                    yield draft_pb2.GenerateResponse(stats=wire.stats_to_proto(event))
        finally:
            if not task.done():  # the client went away: cancelling frees the sequence on both services
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
