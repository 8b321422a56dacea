"""The draft's verifier link against a scripted in-process verifier: the client's deadline travels in the open
message, a proposal for a sequence not open on the current stream is refused locally (LinkDown) rather than
sent to a verifier that does not know it, and a reopen carries the verified output."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from scripted_verifiers import serve_scripted, until

from common.sampling import SamplingParams
from draft_service.types import DraftBlock, StreamLost
from draft_service.verifier_link import LinkDown, VerifierLink
from specwire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc, wire


class ScriptedVerifier(verifier_pb2_grpc.VerifierServicer):
    """Records every DraftMessage; ends the current stream on request."""

    def __init__(self) -> None:
        self.received: list[verifier_pb2.DraftMessage] = []
        self.info = verifier_pb2.VerifierInfo(model_id="scripted", vocab_size=100, tokenizer_fingerprint="fp",
                                              max_draft_tokens=8, max_model_len=512)
        self.hang_up = asyncio.Event()

    async def GetInfo(self, request, context):
        return self.info

    async def Verify(self, request_iterator, context):
        async def read() -> None:
            async for msg in request_iterator:
                self.received.append(msg)

        reader = asyncio.create_task(read())
        yield verifier_pb2.VerifierMessage(welcome=verifier_pb2.Welcome(info=self.info))
        await self.hang_up.wait()
        self.hang_up.clear()
        reader.cancel()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted hang-up")


def test_deadline_and_resume_travel_in_the_open_message_and_stale_streams_refuse_proposals():
    async def run() -> None:
        verifier = ScriptedVerifier()
        server, address = await serve_scripted(verifier)
        link = VerifierLink(address, draft_model_id="d", vocab_size=100, tokenizer_fingerprint="fp")
        try:
            sampling = SamplingParams(temperature=0.0, max_tokens=10, seed=1)
            seq_id = await link.open([1, 2, 3], sampling, retry_s=5, deadline=time.monotonic() + 5)
            await until(lambda: any(m.WhichOneof("kind") == "open" for m in verifier.received))
            opened = next(m.open for m in verifier.received if m.WhichOneof("kind") == "open")
            assert opened.HasField("timeout_ms") and 4000 < opened.timeout_ms <= 5000
            assert list(opened.prompt_token_ids) == [1, 2, 3] and opened.num_output_tokens == 0

            verifier.hang_up.set()  # the stream breaks: the sequence learns it, the link reconnects by itself
            assert isinstance(await asyncio.wait_for(link.next_event(seq_id), 5), StreamLost)
            await until(lambda: link.connected)
            with pytest.raises(LinkDown):  # not reopened on the new stream yet
                link.propose(seq_id, 5, DraftBlock((7,), None), send_draft_probs=False)
            verifier.received.clear()
            await link.reopen(seq_id, [1, 2, 3, 9, 9], sampling, num_output_tokens=2, retry_s=5)
            link.propose(seq_id, 5, DraftBlock((7,), None, draft_seconds=0.25), send_draft_probs=False,
                         assumed_token_ids=(9,))
            await until(lambda: len(verifier.received) >= 2)
            reopened, proposal = verifier.received[0].open, verifier.received[1].propose
            assert list(reopened.prompt_token_ids) == [1, 2, 3, 9, 9] and reopened.num_output_tokens == 2
            assert not reopened.HasField("timeout_ms")
            assert wire.sampling_from_proto(reopened.sampling).seed == 1
            assert proposal.start_position == 5 and list(proposal.assumed_token_ids) == [9]
            assert proposal.HasField("draft_seconds") and proposal.draft_seconds == pytest.approx(0.25)
        finally:
            await link.close()
            await server.stop(0)

    asyncio.run(run())


def test_each_verdict_that_goes_on_is_reported_as_it_arrives():
    """on_verdict (draft_service.due_rounds) hears of every verdict whose sequence goes on, with its step (None
    when unstated) and the step's count, also when no generation here awaits it any more (seq id None); a final
    verdict, a dropped proposal and a verdict from a verifier the sequence left are not verdicts it waits for."""
    from draft_service.verifier_link import _Placed

    heard = []

    async def run() -> None:
        link = VerifierLink("127.0.0.1:1", draft_model_id="d", vocab_size=100, tokenizer_fingerprint="fp",
                            on_verdict=lambda *args: heard.append(args))
        try:
            link._placed[5] = _Placed("127.0.0.1:1", 1)
            link._inboxes[5] = asyncio.Queue()

            def verdict(seq_id: int, **kw) -> verifier_pb2.VerifierMessage:
                return verifier_pb2.VerifierMessage(verdict=verifier_pb2.Verdict(seq_id=seq_id, token_ids=[3], **kw))

            link._dispatch("127.0.0.1:1", verdict(5, step=8, step_verdicts=2))
            link._dispatch("127.0.0.1:1", verdict(6, step=8, step_verdicts=2))  # released here meanwhile
            link._dispatch("127.0.0.1:1", verdict(5))  # an older verifier: no step
            link._dispatch("127.0.0.1:1", verdict(5, step=9, step_verdicts=1, finish_reason=common_pb2.FINISH_REASON_LENGTH))
            link._dispatch("127.0.0.1:1", verifier_pb2.VerifierMessage(dropped=verifier_pb2.ProposalDropped(seq_id=5)))
            link._dispatch("127.0.0.1:2", verdict(5, step=3, step_verdicts=2))  # a verifier it left
            assert link._inboxes[5].qsize() == 4
        finally:
            await link.close()

    asyncio.run(run())
    stream = 0  # the connection's number: never connected here
    assert heard == [(5, ("127.0.0.1:1", stream, 8), 2), (None, ("127.0.0.1:1", stream, 8), 2), (5, None, 0),
                     (None, ("127.0.0.1:2", 0, 3), 2)]
