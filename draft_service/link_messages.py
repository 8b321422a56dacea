"""The Verify stream's messages on the draft's side, converted once at the wire: what the draft sends (an open, a
proposal) built from its typed values, and what the verifier sends turned into the typed events of
draft_service/types.py."""

from __future__ import annotations

import time

from common.sampling import SamplingParams
from draft_service.types import DraftBlock, DroppedEvent, ErrorEvent, LinkEvent, VerdictEvent
from specwire.v1 import verifier_pb2, wire


def open_message(seq_id: int, token_ids: list[int], sampling: SamplingParams, num_output_tokens: int,
                 deadline: float | None, cache_salt: str | None) -> verifier_pb2.DraftMessage:
    """Open (or reopen) `seq_id` with `token_ids`, the last num_output_tokens of them its verified output; the
    client's deadline travels as the time left (time.monotonic() clocks differ between hosts)."""
    msg = verifier_pb2.OpenSequence(seq_id=seq_id, prompt_token_ids=token_ids, num_output_tokens=num_output_tokens,
                                    sampling=wire.sampling_to_proto(sampling), coupled=sampling.is_coupled)
    if deadline is not None:
        msg.timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
    if cache_salt is not None:
        msg.cache_salt = cache_salt
    return verifier_pb2.DraftMessage(open=msg)


def proposal_message(seq_id: int, start_position: int, block: DraftBlock, *, send_draft_probs: bool,
                     assumed_token_ids: tuple[int, ...], max_draft_tokens: int | None,
                     draft_backlog_tokens: int | None = None) -> verifier_pb2.DraftMessage:
    """`max_draft_tokens`: the cap of the verifier's choice of the next block's length (None: no choice asked);
    `draft_backlog_tokens`: what the next drafting round must feed first, for that choice's price (None: unsaid)."""
    msg = verifier_pb2.Proposal(seq_id=seq_id, start_position=start_position, draft_token_ids=block.token_ids)
    if block.draft_seconds is not None:
        msg.draft_seconds = block.draft_seconds
    if block.catch_up_tokens:
        msg.catch_up_tokens = block.catch_up_tokens
    if max_draft_tokens is not None:
        msg.max_draft_tokens = max_draft_tokens
    if draft_backlog_tokens is not None:
        msg.draft_backlog_tokens = draft_backlog_tokens
    if send_draft_probs and block.draft_probs is not None:
        msg.draft_probs.extend(wire.draft_probs_to_proto(block.draft_probs))
    if block.parents is not None:
        msg.draft_parents.extend(block.parents)
    msg.assumed_token_ids.extend(assumed_token_ids)
    return verifier_pb2.DraftMessage(propose=msg)


def event_of(msg: verifier_pb2.VerifierMessage) -> tuple[int, LinkEvent] | None:
    """(the sequence it is for, the event), or None for a message of no sequence's concern. An error under seq id
    0 names no sequence (a duplicate open, a message the verifier did not understand)."""
    kind = msg.WhichOneof("kind")
    if kind == "verdict":
        v = msg.verdict
        return v.seq_id, VerdictEvent(v.start_position, v.num_accepted, tuple(v.token_ids),
                                      wire.finish_from_proto(v.finish_reason), v.batch_size, v.step_time_s,
                                      time.perf_counter(),
                                      v.next_draft_tokens if v.HasField("next_draft_tokens") else None,
                                      v.step, v.step_verdicts,
                                      v.plain_from if v.HasField("plain_from") else None)
    if kind == "error":
        e = msg.error
        return e.seq_id, ErrorEvent(wire.error_code_from_proto(e.code), e.message)
    if kind == "dropped":
        d = msg.dropped
        return d.seq_id, DroppedEvent(d.start_position, d.num_verified)
    return None
