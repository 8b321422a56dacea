"""The gRPC edge of the draft service: GenerateRequest -> GenerationRequest, events -> GenerateResponse."""

from __future__ import annotations

import grpc
import structlog

from common.errors import SpecwireError
from common.sampling import FinishReason, SamplingParams
from draft_service.generation import Generator
from draft_service.types import GenerationRequest, GenerationStats, TextChunk
from specwire.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = structlog.get_logger(__name__)

_FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
DEFAULT_MAX_TOKENS = 16


def request_from_proto(msg: draft_pb2.GenerateRequest) -> GenerationRequest:
    s = msg.sampling
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS,
        ignore_eos=s.ignore_eos,
    )
    kind = msg.WhichOneof("prompt")
    return GenerationRequest(
        prompt_text=msg.text if kind == "text" else None,
        prompt_token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        sampling=sampling,
        stop=tuple(msg.stop),
        num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
    )


def stats_to_proto(s: GenerationStats) -> draft_pb2.Stats:
    return draft_pb2.Stats(
        finish_reason=_FINISH[s.finish_reason], num_prompt_tokens=s.num_prompt_tokens,
        num_generated_tokens=s.num_generated_tokens, num_rounds=s.num_rounds, num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens, accepted_per_position=s.accepted_per_position,
        drafted_per_position=s.drafted_per_position, wall_time_s=s.wall_time_s,
        time_to_first_token_s=s.time_to_first_token_s, draft_time_s=s.draft_time_s,
        verify_wait_s=s.verify_wait_s, num_speculative_tokens=s.num_speculative_tokens, verify_time_s=s.verify_time_s)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, generator: Generator) -> None:
        self._generator = generator

    async def Generate(self, request: draft_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = request_from_proto(request)
            async for event in self._generator.generate(req):
                if isinstance(event, TextChunk):
                    yield draft_pb2.GenerateResponse(chunk=draft_pb2.Chunk(token_ids=event.token_ids, text=event.text))
                else:
                    yield draft_pb2.GenerateResponse(stats=stats_to_proto(event))
        except SpecwireError as err:
            log.info("generate_refused", code=err.code.name, message=err.message)
            await context.abort(grpc.StatusCode[err.code.name], err.message)
