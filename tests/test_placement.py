"""A draft with several verifiers, against scripted in-process verifiers: the --verifier forms, the placement rule
(load, cached prefix, balance, a full pool), and the link's moves: a sequence whose verifier's stream breaks is
reopened on another, one whose verifier drains is never placed there, a verifier's late events for a sequence
that left it are dropped, and a dns:/// name is resolved to its addresses."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from scripted_verifiers import serve_scripted, until

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from draft_service.metrics import DraftMetrics
from draft_service.placement import (
    PREFIX_CHUNK_TOKENS,
    VerifierLoad,
    VerifierState,
    VerifierTargets,
    choose,
    prefix_hashes,
)
from draft_service.types import StreamLost, VerdictEvent
from draft_service.verifier_link import VerifierLink
from specwire.v1 import verifier_pb2, verifier_pb2_grpc

SAMPLING = SamplingParams(temperature=0.0, max_tokens=10, seed=1)


def test_the_verifier_flag_takes_one_address_a_list_or_a_dns_name():
    assert VerifierTargets.parse("a:1").addresses == ("a:1",)
    assert VerifierTargets.parse(" a:1, [::1]:2 ").addresses == ("a:1", "[::1]:2")
    dns = VerifierTargets.parse("dns:///verifiers.ns.svc:50051")
    assert (dns.dns_host, dns.dns_port, dns.resolves) == ("verifiers.ns.svc", 50051, True)
    for bad in ("a", "a:1,a:1", "a:x", "dns:///a", ",", "a:0", ":5"):
        with pytest.raises(ValueError, match="HOST:PORT|twice"):
            VerifierTargets.parse(bad)


def test_a_dns_name_resolves_to_its_addresses():
    addresses = asyncio.run(VerifierTargets.parse("dns:///localhost:7000").resolve())
    assert "127.0.0.1:7000" in addresses
    assert all(a.endswith(":7000") for a in addresses)


def _state(address: str, running: int = 0, waiting: int = 0, usage: float = 0.0, free: int = 100) -> VerifierState:
    state = VerifierState(address)
    state.reported(VerifierLoad(running, waiting, usage, free), draining=False)
    return state


def test_placement_takes_the_least_loaded_verifier_unless_another_caches_the_prefix():
    prompt = list(range(100, 164))  # 4 chunks
    hashes = prefix_hashes(prompt, None)
    assert len(hashes) == len(prompt) // PREFIX_CHUNK_TOKENS
    assert prefix_hashes(prompt, "tenant") != hashes  # a salt never shares another's prefix
    a, b = _state("a", running=5), _state("b", running=2)
    assert choose([a, b], hashes, len(prompt)) == (b, "load")
    a.remember(hashes)
    assert choose([a, b], hashes, len(prompt)) == (a, "prefix")
    # a prefix too short (under half the prompt) does not decide
    assert choose([a, b], hashes, 4 * len(prompt)) == (b, "load")
    # far busier (by both measures) than the least loaded one: balance wins over the cache
    a.reported(VerifierLoad(40, 0, 0.1, 100), draining=False)
    assert choose([a, b], hashes, len(prompt)) == (b, "load")
    # a queued sequence counts twice; a full pool is taken last
    c, d = _state("c", running=1, waiting=3), _state("d", running=6)
    assert choose([c, d], [], 10)[0] is d
    e, f = _state("e", usage=0.97), _state("f", running=30)
    assert choose([e, f], [], 10)[0] is f


def _place(a: VerifierState, b: VerifierState, n: int, *, stale_reports: bool = False) -> list[str]:
    """Where n sequences placed one after another go; with stale_reports, each verifier chosen then reports a load
    it measured before it read the open."""
    picks = []
    for seq_id in range(n):
        state, _reason = choose([a, b], [], 10)
        state.placed(seq_id, [])
        picks.append(state.address)
        if stale_reports:
            state.reported(VerifierLoad(0, 0, 0.0, 100), draining=False)
    return picks


def test_sequences_placed_between_two_reports_spread():
    picks = _place(_state("a"), _state("b"), 6)
    assert picks.count("a") == picks.count("b") == 3


def test_a_report_sent_before_the_opens_arrived_does_not_forget_them():
    """Reports come every 0.2 s: one the verifier sent before it read this draft's opens must not erase them, or a
    burst of opens piles onto the verifier that reported last (the compose check once saw all 4 of its streams on
    one of two verifiers). A sequence counts on top of the reports until its verifier answers about it."""
    a, b = _state("a"), _state("b")
    picks = _place(a, b, 6, stale_reports=True)
    assert picks.count("a") == picks.count("b") == 3
    assert a.busy == b.busy == 3
    # answered: the reports count them from now on
    for seq_id in range(6):
        (a if seq_id in a.unanswered else b).answered(seq_id)
    assert a.busy == b.busy == 0
    a.reported(VerifierLoad(3, 0, 0.0, 97), draining=False)
    assert a.busy == 3
    # a new stream to it: nothing from the old one counts
    a.placed(9, [])
    a.reset()
    assert a.unanswered == set()


class LoadReportingVerifier(verifier_pb2_grpc.VerifierServicer):
    """Welcomes, records what it gets, sends what the test queues (load reports, verdicts), and hangs up on
    request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[verifier_pb2.DraftMessage] = []
        self.info = verifier_pb2.VerifierInfo(model_id="scripted", vocab_size=100, tokenizer_fingerprint="fp",
                                              max_draft_tokens=8, max_model_len=512, features=["load"])
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.hang_up = asyncio.Event()

    def opened(self) -> list[int]:
        return [m.open.seq_id for m in self.received if m.WhichOneof("kind") == "open"]

    async def GetInfo(self, request, context):
        return self.info

    async def Verify(self, request_iterator, context):
        async def read() -> None:
            async for msg in request_iterator:
                self.received.append(msg)

        reader = asyncio.create_task(read())
        yield verifier_pb2.VerifierMessage(welcome=verifier_pb2.Welcome(info=self.info))
        while True:
            get = asyncio.create_task(self.outbox.get())
            hang = asyncio.create_task(self.hang_up.wait())
            done, _ = await asyncio.wait({get, hang}, return_when=asyncio.FIRST_COMPLETED)
            if hang in done:
                get.cancel()
                self.hang_up.clear()
                reader.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted hang-up")
            hang.cancel()
            yield get.result()

    def report(self, running: int = 0, waiting: int = 0, draining: bool = False) -> None:
        self.outbox.put_nowait(verifier_pb2.VerifierMessage(load=verifier_pb2.VerifierLoad(
            num_running=running, num_waiting=waiting, kv_cache_usage=0.1, num_free_blocks=100, draining=draining)))

    def verdict(self, seq_id: int, tokens: list[int]) -> None:
        self.outbox.put_nowait(verifier_pb2.VerifierMessage(verdict=verifier_pb2.Verdict(
            seq_id=seq_id, start_position=3, token_ids=tokens)))


@contextlib.asynccontextmanager
async def _two_verifiers(dns: bool = False):
    """Two load-reporting verifiers and a link to both, connected (with `dns`: a dns:/// target that resolves to
    the first only, _Resolving, and not connected yet): (one, two, address1, address2, link, metrics)."""
    one, two = LoadReportingVerifier("one"), LoadReportingVerifier("two")
    (server1, address1), (server2, address2) = await serve_scripted(one), await serve_scripted(two)
    metrics = DraftMetrics()
    target = "dns:///verifiers.test:1" if dns else f"{address1},{address2}"
    link = VerifierLink(target, draft_model_id="d", vocab_size=100, tokenizer_fingerprint="fp", metrics=metrics)
    try:
        if dns:
            link._targets = _Resolving([address1])
        else:
            await link.ensure_connected(5)
            await until(lambda: all(v.connection.connected for v in link._verifiers.values()))
        yield one, two, address1, address2, link, metrics
    finally:
        await link.close()
        await server1.stop(0)
        await server2.stop(0)


def test_a_stale_report_leaves_an_open_counted_until_its_verifier_answers():
    async def run() -> None:
        async with _two_verifiers() as (one, two, address1, address2, link, metrics):
            one.report()
            two.report()
            await until(lambda: all(v.state.load is not None for v in link._verifiers.values()))
            first = await link.open([1, 2, 3], SAMPLING, retry_s=5)
            servers = {address1: one, address2: two}
            here = next(a for a, n in link.sequences_per_verifier().items() if n == 1)
            servers[here].report()  # sent before it read the open
            state = link._verifiers[here].state
            await until(servers[here].outbox.empty)
            await asyncio.sleep(0.2)  # read by the link
            assert state.busy == 1
            second = await link.open([4, 5, 6], SAMPLING, retry_s=5)
            assert link.sequences_per_verifier() == {address1: 1, address2: 1}
            # its verdict: the verifier's reports count it from now on
            servers[here].verdict(first, [7])
            await asyncio.wait_for(link.next_event(first), 5)
            assert state.unanswered == set() and state.busy == 0
            other = link._verifiers[next(a for a in servers if a != here)].state
            assert other.unanswered == {second}
            # released before any reply (a cancelled request): it counts no more
            link.release(second, cancel=True)
            assert other.unanswered == set()

    asyncio.run(run())


def test_a_sequence_moves_when_its_verifier_goes_and_a_draining_verifier_takes_none():
    async def run() -> None:
        async with _two_verifiers() as (one, two, address1, address2, link, metrics):
            one.report(running=9)  # the busier one
            two.report(running=1)
            await until(lambda: all(v.state.load is not None for v in link._verifiers.values()))
            seq = await link.open([1, 2, 3], SAMPLING, retry_s=5)
            await until(lambda: two.opened() == [seq])
            assert link.sequences_per_verifier() == {address1: 0, address2: 1}

            # its verifier goes: the sequence learns it, and its reopen goes to the other one at once
            two.hang_up.set()
            assert isinstance(await asyncio.wait_for(link.next_event(seq), 5), StreamLost)
            await link.reopen(seq, [1, 2, 3, 4], SAMPLING, num_output_tokens=1, retry_s=5)
            await until(lambda: one.opened() == [seq])
            reopened = next(m.open for m in one.received if m.WhichOneof("kind") == "open")
            assert list(reopened.prompt_token_ids) == [1, 2, 3, 4] and reopened.num_output_tokens == 1
            assert metrics.failovers._value.get() == 1
            assert metrics.placements.labels(reason="failover")._value.get() == 1
            # the verifier it left is back: a late verdict from it for the sequence is not the sequence's
            await until(lambda: link._verifiers[address2].connection.connected)
            two.verdict(seq, [7])
            await asyncio.sleep(0.3)  # it would arrive first
            one.verdict(seq, [8])
            event = await asyncio.wait_for(link.next_event(seq), 5)
            assert isinstance(event, VerdictEvent) and event.token_ids == (8,)

            # one drains: new sequences go to the other, whatever the loads say
            one.report(running=0, draining=True)
            two.report(running=50)
            await until(lambda: link._verifiers[address1].state.draining)
            await until(lambda: (link._verifiers[address2].state.load or VerifierLoad()).num_running == 50)
            others = [await link.open([5, 6], SAMPLING, retry_s=5) for _ in range(3)]
            await until(lambda: two.opened() == [seq, *others] or set(others) <= set(two.opened()))
            assert not set(others) & set(one.opened())
            # every verifier draining or gone: an open waits, then fails with UNAVAILABLE
            two.report(draining=True)
            await until(lambda: link._verifiers[address2].state.draining)
            with pytest.raises(ServiceError) as err:
                await link.open([5, 6], SAMPLING, retry_s=0.3)
            assert err.value.code is ErrorCode.UNAVAILABLE and "no verifier" in err.value.message

    asyncio.run(run())


def test_a_sequence_stays_on_its_verifier_when_that_one_comes_back():
    async def run() -> None:
        async with _two_verifiers() as (one, two, address1, address2, link, metrics):
            seq = await link.open([1, 2, 3], SAMPLING, retry_s=5)
            await until(lambda: seq in one.opened() + two.opened())
            home = one if seq in one.opened() else two
            home_address = address1 if home is one else address2
            home.hang_up.set()
            assert isinstance(await asyncio.wait_for(link.next_event(seq), 5), StreamLost)
            await until(lambda: link._verifiers[home_address].connection.connected)
            await link.reopen(seq, [1, 2, 3, 4], SAMPLING, num_output_tokens=1, retry_s=5)
            await until(lambda: home.opened() == [seq, seq])
            assert metrics.placements.labels(reason="resume")._value.get() == 1
            assert metrics.failovers._value.get() == 0

    asyncio.run(run())


class _Resolving:
    """A dns:/// target whose answer the test sets."""

    resolves = True
    dns_host = "verifiers.test"

    def __init__(self, addresses: list[str]) -> None:
        self.addresses_now = addresses

    async def resolve(self) -> tuple[str, ...]:
        return tuple(self.addresses_now)


def test_a_dns_target_is_followed_as_verifiers_come_and_go(monkeypatch):
    import draft_service.verifier_link as verifier_link

    monkeypatch.setattr(verifier_link, "MIN_RESOLVE_INTERVAL_S", 0.0)

    async def run() -> None:
        async with _two_verifiers(dns=True) as (one, two, address1, address2, link, _):
            resolving = link._targets
            await link.ensure_connected(5)  # resolves first: only one is known
            assert set(link._verifiers) == {address1}
            seq = await link.open([1, 2, 3], SAMPLING, retry_s=5)
            await until(lambda: one.opened() == [seq])

            resolving.addresses_now = [address1, address2]  # a verifier comes
            await link.refresh(force=True)
            link.reconnect_in_background()
            await until(lambda: link._verifiers[address2].connection.connected)
            resolving.addresses_now = [address2]  # the first one goes from the name
            await link.refresh(force=True)
            assert link._verifiers[address1].state.gone  # kept while a sequence of this draft is on it
            others = [await link.open([4, 5], SAMPLING, retry_s=5) for _ in range(2)]
            await until(lambda: two.opened() == others)
            link.release(seq, cancel=True)
            await link.refresh(force=True)
            assert set(link._verifiers) == {address2}  # closed once nothing of this draft is left on it

    asyncio.run(run())


def test_a_verifier_without_load_reports_is_not_left_marked_draining_after_a_reconnection():
    """A drained verifier replaced, on its address, by an older one (no "load" feature): no report would ever
    clear the flag, so the reconnection does."""
    async def run() -> None:
        async with _two_verifiers() as (one, _, address1, _, link, _):
            one.info.ClearField("features")  # its next welcome comes from a verifier without load reports
            link._verifiers[address1].state.draining = True
            connections = link._verifiers[address1].connection.num_connections
            one.hang_up.set()
            await until(lambda: link._verifiers[address1].connection.num_connections > connections)
            assert not link._verifiers[address1].state.draining

    asyncio.run(run())
