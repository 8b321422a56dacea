"""The Verify stream through the real servicer, engine and a gRPC server in this process: the q limit travels in
GetInfo and a draft that passes it is refused per proposal, never as a protocol error; an open refused on the
stream's side is a protocol error, and one under a live sequence's id leaves that sequence alone; a stream that
fails while its peer does not read gives its --max-streams slot back at once."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from structlog.testing import capture_logs

from common.compute_thread import compute_thread
from common.sampling import SamplingParams
from draft_service.verifier_link import VerifierLink
from specwire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import VerifierConfig
from verifier_service.metrics import VerifierMetrics
from verifier_service.server import build_engine, verifier_info
from verifier_service.servicer import VerifierServicer
from verifier_service.stream_outbox import StreamLimits
from verifier_service.types import OpenCmd, SeqKey

from tiny_models import make_text_pair

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
MAX_Q_SUPPORT = 8
# A peer whose stream window is 1 KiB and never grows: one that does not read blocks the server's sends after a
# few dozen small replies, as a draft that stopped reading does after gRPC's buffers fill.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target, _ = make_text_pair(tmp_path_factory.mktemp("verify-stream"), "qwen2")
    return target


@contextlib.asynccontextmanager
async def _serving(target, goodput: bool = True, **limits):
    """A verifier in this event loop: (address, its AsyncEngine, its metrics)."""
    config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=4, num_blocks=32,
                            max_q_support=MAX_Q_SUPPORT, goodput=goodput)
    executor = compute_thread("test-verifier")
    engine = await asyncio.get_running_loop().run_in_executor(executor, build_engine, config)
    metrics = VerifierMetrics()
    async_engine = AsyncEngine(engine, metrics, executor, limits=StreamLimits(**limits))
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(
        VerifierServicer(async_engine, verifier_info(engine, config)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    async_engine.start()
    await server.start()
    try:
        yield f"127.0.0.1:{port}", async_engine, metrics
    finally:
        await server.stop(0)
        await async_engine.stop()


class _Stream:
    """A Verify stream driven by hand: send() queues messages, next() reads a reply."""

    def __init__(self, channel: grpc.aio.Channel, info: verifier_pb2.VerifierInfo, load_reports: bool = False) -> None:
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.send(verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(
            draft_model_id="test", vocab_size=info.vocab_size, tokenizer_fingerprint=info.tokenizer_fingerprint,
            load_reports=load_reports)))
        self.call = verifier_pb2_grpc.VerifierStub(channel).Verify(self._requests(), timeout=60)

    async def _requests(self):
        while True:
            yield await self._outbox.get()

    def send(self, *messages) -> None:
        for m in messages:
            self._outbox.put_nowait(m)

    async def next(self, kind: str | None = None):
        while True:
            reply = await asyncio.wait_for(self.call.read(), 30)
            assert reply is not grpc.aio.EOF, "the stream ended"
            if kind is None or reply.WhichOneof("kind") == kind:
                return reply

    async def status(self) -> grpc.aio.AioRpcError:
        """Read to the end; the error the stream ended with. Messages still to be written when it ends may make
        gRPC's client fail the call itself (INTERNAL), so send none after what ends it."""
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await asyncio.wait_for(self.call.read(), 10) is not grpc.aio.EOF:
                pass
        return err.value


def _open(seq_id, prompt=(5, 6, 7), **kw):
    cache_salt = kw.pop("cache_salt", None)
    sampling = common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 50, **kw})
    return verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=seq_id, prompt_token_ids=list(prompt), sampling=sampling, cache_salt=cache_salt))


def _propose(seq_id, start, drafts=(), q=None):
    msg = verifier_pb2.Proposal(seq_id=seq_id, start_position=start, draft_token_ids=list(drafts))
    for ids, probs in q or ():
        msg.draft_probs.append(verifier_pb2.SparseDistribution(token_ids=list(ids), probs=list(probs)))
    return verifier_pb2.DraftMessage(propose=msg)


async def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _info(channel) -> verifier_pb2.VerifierInfo:
    return await verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)


def test_the_q_limit_is_advertised_and_a_q_past_it_fails_only_its_proposals(target):
    """GetInfo carries --max-q-support, which the draft's link keeps in its VerifierIdentity. A proposal past it
    is RESOURCE_EXHAUSTED for its sequence, but no protocol error: more of them than --max-protocol-errors
    leave the stream serving."""
    async def scenario():
        async with _serving(target, max_protocol_errors=2) as (address, _, _):
            async with grpc.aio.insecure_channel(address) as channel:
                info = await _info(channel)
                assert info.max_q_support == MAX_Q_SUPPORT
                link = VerifierLink(address, draft_model_id="d", vocab_size=info.vocab_size,
                                    tokenizer_fingerprint=info.tokenizer_fingerprint)
                try:
                    assert (await link.ensure_connected(10)).max_q_support == MAX_Q_SUPPORT
                finally:
                    await link.close()
                s = _Stream(channel, info)
                wide = [(tuple(range(9, 9 + MAX_Q_SUPPORT + 1)), (1 / (MAX_Q_SUPPORT + 1),) * (MAX_Q_SUPPORT + 1))]
                for seq_id in range(1, 6):
                    s.send(_open(seq_id, temperature=0.8, seed=1), _propose(seq_id, 3, drafts=(9,), q=wide))
                errors = [(await s.next("error")).error for _ in range(5)]
                assert {(e.code, "--max-q-support" in e.message) for e in errors} == {(EXHAUSTED, True)}
                s.send(_open(9), _propose(9, 3))
                assert (await s.next("verdict")).verdict.seq_id == 9  # the stream still serves
                s.call.cancel()

    asyncio.run(scenario())


def test_an_open_refused_under_a_live_id_names_no_sequence_and_counts_as_a_protocol_error(target):
    async def scenario():
        async with _serving(target, max_protocol_errors=2) as (address, _, _):
            async with grpc.aio.insecure_channel(address) as channel:
                info = await _info(channel)
                s = _Stream(channel, info)
                s.send(_open(1), _propose(1, 3))
                assert (await s.next("verdict")).verdict.seq_id == 1
                s.send(_open(1, cache_salt=""))  # refused on the stream's side, under a live sequence's id
                error = (await s.next("error")).error
                assert (error.seq_id, error.code) == (0, INVALID), error
                assert "cache_salt" in error.message and "sequence 1 is already open" in error.message
                s.send(_propose(1, 4))
                assert (await s.next("verdict")).verdict.seq_id == 1  # it goes on
                # refusals on the stream's side count: past 2 (--max-protocol-errors) in a row, the stream ends
                s.send(_open(2, cache_salt=""), _open(3, temperature=-1.0), _open(4, prompt=(5,) * 600))
                err = await s.status()
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-protocol-errors" in err.details()

    asyncio.run(scenario())


def test_a_stream_failed_while_its_peer_does_not_read_frees_its_slot_at_once(target):
    """The peer stops reading: the servicer blocks sending, the backlog passes --max-stream-backlog and the
    stream fails. Its slot (--max-streams 1) and its blocks are free while the peer still does not read, and
    its call ends once the peer reads."""
    def num_streams(metrics) -> float:
        return metrics.registry.get_sample_value("specwire_verify_streams")

    async def scenario(logs: list[dict]):
        async with _serving(target, max_streams=1, max_stream_backlog=64) as (address, async_engine, metrics):
            blocks = async_engine.engine.blocks
            async with grpc.aio.insecure_channel(address, options=SMALL_WINDOW) as stalled_channel:
                info = await _info(stalled_channel)
                stalled = _Stream(stalled_channel, info)
                assert (await stalled.next()).WhichOneof("kind") == "welcome"
                stalled.send(_open(1))
                await _until(lambda: blocks.num_used_blocks > 0)  # prefilled
                # each is answered ProposalDropped, which the peer never reads; in bursts well below the backlog,
                # so that the backlog builds up only once the servicer waits for the peer to read
                stale = _propose(1, 1)
                for _ in range(200):
                    stalled.send(*[stale] * 16)
                    await asyncio.sleep(0.02)
                    if num_streams(metrics) == 0:
                        break
                await _until(lambda: num_streams(metrics) == 0 and blocks.num_used_blocks == 0)
                # its handler has ended (it does not wait for the peer to read first)
                await _until(lambda: any(e["event"] == "verify_stream_closed" for e in logs))
                async with grpc.aio.insecure_channel(address) as channel:
                    fresh = _Stream(channel, info)
                    assert (await fresh.next()).WhichOneof("kind") == "welcome"  # the slot is free
                    fresh.send(_open(1), _propose(1, 3))
                    assert (await fresh.next("verdict")).verdict.seq_id == 1
                    fresh.call.cancel()
                # its status is RESOURCE_EXHAUSTED (test_bad_input checks it), unless gRPC's client fails the call
                # itself (INTERNAL) for the proposals it still had queued to write
                await stalled.status()

    with capture_logs() as logs:
        asyncio.run(scenario(logs))
    failed = [e for e in logs if e["event"] == "verify_stream_failed"]
    assert [e["code"] for e in failed] == ["RESOURCE_EXHAUSTED"] and "--max-stream-backlog" in failed[0]["message"]


def test_stop_ends_the_engine_loop_when_a_stream_closes_in_the_same_turn(target):
    """A stream closing as the server stops wakes the engine loop in the turn it is cancelled; Python 3.11's
    asyncio.wait_for then swallows the cancel, and stop() must still end the loop (not hang the shutdown)."""
    async def scenario():
        config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=4, num_blocks=32)
        executor = compute_thread("test-verifier")
        engine = await asyncio.get_running_loop().run_in_executor(executor, build_engine, config)
        async_engine = AsyncEngine(engine, VerifierMetrics(), executor)
        async_engine.start()
        stream_id, _ = async_engine.open_stream()
        greedy = SamplingParams(temperature=0.0, max_tokens=8).with_seed()
        async_engine.submit(OpenCmd(SeqKey(stream_id, 1), (3, 4, 5), greedy))
        await _until(lambda: engine.blocks.num_used_blocks > 0)  # prefilled: the loop waits for work (or expiry)
        await asyncio.sleep(0.05)
        async_engine.close_stream(stream_id)
        await asyncio.wait_for(async_engine.stop(), 10)

    asyncio.run(scenario())


def test_the_goodput_choice_reaches_only_proposals_that_ask_for_it(target):
    """A draft older than the goodput fields sends no max_draft_tokens and gets verdicts without a choice, as
    before; a proposal that asks gets a choice within its cap."""

    async def main() -> None:
        async with _serving(target) as (address, _, _), grpc.aio.insecure_channel(address) as channel:
            info = await _info(channel)
            assert "goodput" in info.features
            s = _Stream(channel, info)
            await s.next("welcome")
            s.send(_open(1), _propose(1, 3, (9, 9)))  # as an older draft sends it
            v = (await s.next("verdict")).verdict
            assert not v.HasField("next_draft_tokens")
            ask = _propose(1, 3 + len(v.token_ids), (9,))
            ask.propose.max_draft_tokens = 3
            s.send(ask)
            v = (await s.next("verdict")).verdict
            assert v.HasField("next_draft_tokens") and 0 <= v.next_draft_tokens <= 3

    asyncio.run(main())


@pytest.mark.parametrize("goodput", [True, False])
def test_the_link_asks_for_a_choice_only_where_the_verifier_lists_goodput(target, goodput):
    """A new draft in front of a verifier that does not list the feature (older, or --goodput false) sends no
    max_draft_tokens and gets no choice: it drafts by its own rule."""
    from draft_service.types import DraftBlock, VerdictEvent

    async def main() -> None:
        async with _serving(target, goodput=goodput) as (address, async_engine, _):
            loaded = async_engine.engine.loaded
            link = VerifierLink(address, draft_model_id="d", vocab_size=loaded.vocab_size,
                                tokenizer_fingerprint=loaded.tokenizer_fingerprint)
            sent = []
            connection = link._verifiers[address].connection
            send = connection.send
            connection.send = lambda message: (sent.append(message), send(message))[1]
            try:
                await link.ensure_connected(10)
                assert ("goodput" in link.identity.features) is goodput
                seq_id = await link.open([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20).with_seed(),
                                         retry_s=5)
                link.propose(seq_id, 3, DraftBlock((9, 9), None), send_draft_probs=False, max_draft_tokens=3,
                             draft_backlog_tokens=2)
                event = await asyncio.wait_for(link.next_event(seq_id), 30)
                assert isinstance(event, VerdictEvent)
                (proposal,) = [m.propose for m in sent if m.WhichOneof("kind") == "propose"]
                assert proposal.HasField("max_draft_tokens") is goodput
                # the backlog is the choice's price: it goes with the ask, or not at all
                assert proposal.HasField("draft_backlog_tokens") is goodput
                assert proposal.draft_backlog_tokens == (2 if goodput else 0)
                assert (event.next_draft_tokens is not None) is goodput
            finally:
                await link.close()

    asyncio.run(main())


def test_load_reports_and_a_drain_that_refuses_new_sequences_and_waits_for_the_running_ones(target):
    """A stream whose hello asks for load reports gets one after the welcome and on every change; a drain says so
    at once, refuses new opens with UNAVAILABLE, lets the running sequence finish, and returns when none is left
    (or at its grace period, with the count left). A stream that did not ask gets no report."""
    async def main() -> None:
        async with _serving(target) as (address, async_engine, metrics):
            async with grpc.aio.insecure_channel(address) as channel:
                info = await verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetInfoRequest())
                assert "load" in info.features
                plain, reported = _Stream(channel, info), _Stream(channel, info, load_reports=True)
                assert (await plain.next()).WhichOneof("kind") == "welcome"
                assert (await reported.next()).WhichOneof("kind") == "welcome"
                first = (await reported.next()).load
                assert (first.num_running, first.num_waiting, first.draining) == (0, 0, False)
                assert first.num_free_blocks == 32 and first.kv_cache_usage == 0
                reported.send(_open(1, max_tokens=40))
                reported.send(verifier_pb2.DraftMessage(propose=verifier_pb2.Proposal(seq_id=1, start_position=3)))
                verdicts, load = 0, first
                while not verdicts or load.num_free_blocks == 32:  # the sequence holds blocks now
                    reply = await reported.next()
                    verdicts += reply.WhichOneof("kind") == "verdict"
                    load = reply.load if reply.WhichOneof("kind") == "load" else load
                assert verdicts == 1 and load.kv_cache_usage > 0 and load.num_running == 1
                drain = asyncio.create_task(async_engine.drain(30))
                while not (reply := await reported.next("load")).load.draining:
                    pass
                plain.send(_open(2))
                error = (await plain.next()).error  # the next message: this stream never asked for reports
                assert error.seq_id == 2 and error.code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert "draining" in error.message
                assert not drain.done()  # sequence 1 still runs
                position = 4
                while True:  # it finishes (max_tokens) while the verifier drains
                    reported.send(verifier_pb2.DraftMessage(propose=verifier_pb2.Proposal(
                        seq_id=1, start_position=position)))
                    verdict = (await reported.next("verdict")).verdict
                    position += len(verdict.token_ids)
                    if verdict.finish_reason:
                        break
                assert await asyncio.wait_for(drain, 10) == 0
                assert metrics.draining._value.get() == 1
                assert await async_engine.drain(0) == 0
                plain.call.cancel()
                reported.call.cancel()

    asyncio.run(main())
