"""The gateway's answers to a generation request: one JSON body, or server-sent events as the tokens come, in
OpenAI's shapes. A client that goes away cancels its generation on both services."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.api_errors import ApiError, from_grpc
from gateway.metrics import InFlight
from specwire.client import AsyncClient, Chunk, Result, Stats
from specwire.errors import SpecwireError

log = structlog.get_logger(__name__)

DISCONNECT_POLL_S = 0.25


class Answers:
    """Answers for the model named `model` (the name the gateway serves)."""

    def __init__(self, model: str) -> None:
        self.model = model

    async def respond(self, client: AsyncClient, request: Request, body, kwargs: dict, prefix: str, kind: str,
                      choice, flight: InFlight) -> Response:
        """The answer; `flight` ends here, or, for a stream, when its response has been sent or abandoned."""
        rid, t0 = new_id(prefix), time.perf_counter()
        if body.stream:
            result = Result()
            try:
                chunks = client.stream(**kwargs, result=result)
                try:  # the first chunk before the headers: a request the services refuse gets its own status
                    first = await anext(chunks)
                except StopAsyncIteration:
                    first = None
                except SpecwireError as err:
                    raise from_grpc(err.code, err.message) from None
            except BaseException:
                flight.finish()
                raise
            flight.started()
            events = self._stream(body, chunks, first, result, rid, kind, choice)
            return _EventStream(_sse(events, rid, t0), flight, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            result = await _unless_disconnected(request, _collect(client, kwargs, flight))
        except SpecwireError as err:
            raise from_grpc(err.code, err.message) from None
        finally:
            flight.finish()
        if result is None:  # the client went away; the generation was cancelled
            log.info("gateway_request", id=rid, outcome="disconnected")
            return Response(status_code=499)
        out = {"id": rid, "object": kind, "created": now(), "model": self.model,
               "choices": [choice(result.text, finish_reason(result), final=True)], "usage": usage(result)}
        if body.specwire_stats:
            out["specwire_stats"] = stats_extension(result.stats)
        log.info("gateway_request", id=rid, outcome="ok", tokens=len(result.token_ids),
                 wall_s=round(time.perf_counter() - t0, 4))
        return JSONResponse(out, headers={"X-Request-Id": rid})

    async def _stream(self, body, chunks: AsyncIterator[Chunk], first: Chunk | None, result: Result, rid: str,
                      kind: str, choice) -> AsyncIterator[dict]:
        chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
        head = {"id": rid, "object": chunk_kind, "created": now(), "model": self.model}
        extra = {"usage": None} if body.include_usage else {}
        if kind == "chat.completion":  # OpenAI's first chat chunk names the role
            yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
        try:
            if first is not None and first.text:
                yield {**head, "choices": [choice(first.text, None, final=False)], **extra}
            async for chunk in chunks:
                if chunk.text:
                    yield {**head, "choices": [choice(chunk.text, None, final=False)], **extra}
        finally:
            await chunks.aclose()  # also when the client went away: cancels the generation
        last = {**head, "choices": [choice("", finish_reason(result), final=False)], **extra}
        if body.specwire_stats:
            last["specwire_stats"] = stats_extension(result.stats)
        yield last
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage(result)}


class _EventStream(StreamingResponse):
    """A streamed answer that ends its request in the gauges however the response ends: sent, an error, or the
    client gone (an http.disconnect under ASGI 2.3, or an OSError from send under 2.4, which leaves the body
    iterator suspended until the loop finalizes it)."""

    def __init__(self, content: AsyncIterator[str], flight: InFlight, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._flight = flight

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._flight.finish()


async def _collect(client: AsyncClient, kwargs: dict, flight: InFlight) -> Result:
    """An unstreamed generation (as the SDK's generate() does it), telling `flight` when the first token came."""
    result = Result()
    async for _ in client.stream(**kwargs, result=result):
        flight.started()
    return result


def completion_choice(text: str, reason: str | None, *, final: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def chat_choice(text: str, reason: str | None, *, final: bool) -> dict:
    if final:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}
    return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}


async def _sse(events: AsyncIterator[dict], rid: str, t0: float) -> AsyncIterator[str]:
    """Server-sent events. An error after the headers went out is sent as an error event (the status is already
    200), then the stream ends; a client that goes away cancels this generator and with it the generation."""
    outcome = "ok"
    try:
        async for payload in events:
            yield f"data: {json.dumps(payload)}\n\n"
    except SpecwireError as err:
        outcome = "error"
        yield _sse_error(from_grpc(err.code, err.message))
    except asyncio.CancelledError:
        log.info("gateway_request", id=rid, outcome="disconnected", stream=True)
        raise
    yield "data: [DONE]\n\n"
    log.info("gateway_request", id=rid, outcome=outcome, stream=True, wall_s=round(time.perf_counter() - t0, 4))


def _sse_error(err: ApiError) -> str:
    """An error after the headers, as an SSE message every client we know reads as a failure: the `data` line is
    vLLM's and OpenAI's error object (the openai package and guidellm raise on it), the `event: error` field and
    the comment with the message are what aiperf looks for (without them it counted a broken stream as a success
    with fewer tokens). Clients that know neither skip the `event` and comment lines, as SSE says."""
    message = " ".join(err.message.splitlines())
    return f"event: error\n: {message}\ndata: {json.dumps(err.body())}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Result]) -> Result | None:
    """The result, or None (the work cancelled) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()


# -- the answers' fields ---------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(result: Result) -> dict[str, int]:
    s = result.stats
    prompt, completion = (s.num_prompt_tokens, s.num_generated_tokens) if s else (0, len(result.token_ids))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(result: Result) -> str | None:
    reason = result.finish_reason
    return None if reason in (None, "cancelled") else reason


def stats_extension(stats: Stats | None) -> dict | None:
    """The speculative statistics of one request (the `specwire_stats` field), or None."""
    if stats is None:
        return None
    out = asdict(stats)
    out["mean_acceptance_length"] = stats.mean_acceptance_length
    out["acceptance_rate_per_position"] = stats.acceptance_rate_per_position
    return out


def now() -> int:
    return int(time.time())
