"""One draft service in front of two verifier processes (`--verifier A,B`): concurrent requests spread across
them, a prompt whose prefix one of them caches goes there, a verifier SIGKILLed mid-generation hands its
sequences to the other (greedy, seeded and coupled output unchanged, no KV block left), and a SIGTERMed verifier
drains: it takes no new sequence, and those it has not finished within its grace period finish elsewhere."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from specwire import AsyncClient, Client
from specwire.launch import Stack, free_port, scrape_metric

from tiny_models import greedy_continuation, make_text_pair

PROMPT = [5, 9, 14, 3, 22, 7]
N = 200
GREEDY = dict(max_tokens=N, temperature=0.0, ignore_eos=True)
SEEDED = dict(max_tokens=N, temperature=1.0, seed=4242, ignore_eos=True)
COUPLED = dict(max_tokens=N, temperature=0.9, seed=99, ignore_eos=True, wire_mode="coupled")


class TwoVerifiers:
    def __init__(self, tmp) -> None:
        self.target, draft = make_text_pair(tmp, "qwen2")
        self.log_dir = tmp / "logs"
        self.references: list[list[int]] | None = None
        self.stack = Stack()
        self.ports = [0, 0]  # the ports the verifiers bound first; a restart binds its verifier's again
        self.metrics_ports = [free_port(), free_port()]
        try:  # a service that fails to start leaves none of the others running
            self.verifiers = [self.start_verifier(i) for i in range(2)]
            self.draft_metrics = free_port()
            addresses = ",".join(f"127.0.0.1:{p}" for p in self.ports)
            self.draft = self.stack.start("draft", ["draft", "--model", str(draft), "--dtype", "float64",
                                                    "--verifier", addresses, "--num-speculative-tokens", "4",
                                                    "--block-size", "4", "--verifier-retry-deadline", "60",
                                                    "--metrics-port", str(self.draft_metrics)],
                                          log_dir=self.log_dir, timeout_s=120)
        except BaseException:
            self.stack.stop()
            raise

    def start_verifier(self, i: int):
        service = self.stack.start(f"verifier{i}", ["verifier", "--model", str(self.target), "--dtype", "float64",
                                                    "--max-draft-tokens", "8", "--num-blocks", "256", "--block-size",
                                                    "4", "--drain-grace", "0.3", "--metrics-port",
                                                    str(self.metrics_ports[i])],
                                   log_dir=self.log_dir / f"v{i}-{len(self.stack.services)}",
                                   port=self.ports[i] or None, timeout_s=120)
        self.ports[i] = int(service.address.rsplit(":", 1)[1])
        return service

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def metric(self, i: int, name: str) -> float:
        return scrape_metric(f"http://127.0.0.1:{self.metrics_ports[i]}/metrics", name) or 0.0

    def draft_metric(self, name: str, **labels) -> float:
        return scrape_metric(f"http://127.0.0.1:{self.draft_metrics}/metrics", name, labels or None) or 0.0

    def busiest(self) -> tuple[int, float]:
        """The verifier holding the most of the draft's sequences, and how many."""
        on = [self.draft_metric("specwire_draft_verifier_sequences", verifier=self.address(i)) for i in range(2)]
        i = max(range(2), key=lambda j: on[j])
        return i, on[i]

    def wait_for_no_blocks(self, i: int) -> None:
        """A stream's teardown frees its blocks a moment after the last reply."""
        for _ in range(200):
            if self.metric(i, "specwire_kv_blocks_used") == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"verifier {i} still holds {self.metric(i, 'specwire_kv_blocks_used')} KV blocks")

    def wait_connected(self, i: int) -> None:
        """Until the draft has a stream to verifier i again (it reports that verifier's sequence count, 0)."""
        async def wait() -> None:
            for _ in range(400):
                if self.metric(i, "specwire_verify_streams") >= 1:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"the draft did not reconnect to verifier {i}")
        asyncio.run(wait())


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    stack = TwoVerifiers(tmp_path_factory.mktemp("two-verifiers"))
    yield stack
    stack.stack.stop()


async def _streams(two: TwoVerifiers, requests: list[tuple[list[int], dict]], after_tokens: int, action):
    """Run the requests concurrently; once each has streamed after_tokens tokens, run `action` (on a thread)
    while they go on; returns every request's tokens."""
    progressed = [asyncio.Event() for _ in requests]

    async def one(i: int, prompt: list[int], kwargs: dict) -> list[int]:
        tokens: list[int] = []
        async with AsyncClient(two.draft.address, timeout=180) as client:
            async for chunk in client.stream(prompt_token_ids=prompt, **kwargs):
                tokens.extend(chunk.token_ids)
                if len(tokens) >= after_tokens:
                    progressed[i].set()
        return tokens

    tasks = [asyncio.create_task(one(i, p, kw)) for i, (p, kw) in enumerate(requests)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 60)
    assert not any(t.done() for t in tasks), "a generation ended before the action"
    await asyncio.to_thread(action)
    return await asyncio.gather(*tasks)


def test_concurrent_requests_spread_and_a_cached_prefix_goes_where_it_is_cached(two):
    async def burst(prompts: list[list[int]]) -> None:
        async with AsyncClient(two.draft.address, timeout=120) as client:
            await asyncio.gather(*(client.generate(prompt_token_ids=p, max_tokens=24, temperature=0.0,
                                                   ignore_eos=True) for p in prompts))

    before = [two.metric(i, "specwire_prompt_tokens_total") for i in range(2)]
    asyncio.run(burst([[3 + i, 9, 14, 3, 22, 7] for i in range(6)]))
    spread = [two.metric(i, "specwire_prompt_tokens_total") - before[i] for i in range(2)]
    assert all(s > 0 for s in spread), f"prompt tokens per verifier: {spread}"

    shared = [(7 * i) % 50 + 3 for i in range(64)]  # a 64-token prefix
    with Client(two.draft.address, timeout=120) as client:
        client.generate(prompt_token_ids=shared, max_tokens=4, temperature=0.0)
    home = max(range(2), key=lambda i: two.metric(i, "specwire_prompt_tokens_total") - before[i] - spread[i])
    hits = [two.metric(i, "specwire_prefix_cache_hit_tokens_total") for i in range(2)]
    prefix_placements = two.draft_metric("specwire_draft_placements_total", reason="prefix")
    # at once: without the prefix they would spread (as the burst above did)
    asyncio.run(burst([[*shared, 40 + i, 41] for i in range(4)]))
    assert two.draft_metric("specwire_draft_placements_total", reason="prefix") == prefix_placements + 4
    assert two.metric(home, "specwire_prefix_cache_hit_tokens_total") - hits[home] >= 4 * 60
    assert two.metric(1 - home, "specwire_prefix_cache_hit_tokens_total") == hits[1 - home]


def _requests() -> list[tuple[list[int], dict]]:
    return [(PROMPT, GREEDY), (PROMPT, SEEDED), (PROMPT, COUPLED), ([4, *PROMPT], GREEDY), ([4, *PROMPT], SEEDED),
            ([4, *PROMPT], COUPLED)]


def _references(two: TwoVerifiers) -> list[list[int]]:
    """Each request's uninterrupted output (computed once for the module)."""
    if two.references is not None:
        return two.references
    out = []
    with Client(two.draft.address, timeout=180) as client:
        for prompt, kwargs in _requests():
            if kwargs is GREEDY:
                out.append(greedy_continuation(two.target, prompt, N))
            else:  # coupled: the target-alone output for its seed, whatever the rounds
                out.append(client.generate(prompt_token_ids=prompt, **kwargs,
                                           num_speculative_tokens=0 if kwargs is COUPLED else None).token_ids)
    two.references = out
    return out


def test_a_killed_verifier_hands_its_sequences_to_the_other_losslessly(two):
    references = _references(two)
    failovers = two.draft_metric("specwire_draft_failovers_total")
    victim = {}

    def kill() -> None:
        i, sequences = two.busiest()
        victim.update(i=i, sequences=sequences)
        two.verifiers[i].proc.send_signal(signal.SIGKILL)
        two.verifiers[i].proc.wait()

    outputs = asyncio.run(_streams(two, _requests(), 8, kill))
    assert outputs == references
    i = victim["i"]
    assert victim["sequences"] >= 1
    assert two.draft_metric("specwire_draft_failovers_total") >= failovers + victim["sequences"]
    two.wait_for_no_blocks(1 - i)
    two.verifiers[i] = two.start_verifier(i)  # back on its port: the draft reconnects by itself
    two.wait_connected(i)


def test_a_sigterm_drains_the_verifier_and_what_it_did_not_finish_finishes_elsewhere(two):
    references = _references(two)
    failovers = two.draft_metric("specwire_draft_failovers_total")
    drained = {}

    def drain() -> None:
        i, _ = two.busiest()
        drained["i"] = i
        two.verifiers[i].proc.send_signal(signal.SIGTERM)
        drained["rc"] = two.verifiers[i].proc.wait(30)

    outputs = asyncio.run(_streams(two, _requests(), 8, drain))
    assert outputs == references  # and no request failed
    i = drained["i"]
    assert drained["rc"] == 0
    assert two.draft_metric("specwire_draft_failovers_total") > failovers
    two.wait_for_no_blocks(1 - i)
    # the drained verifier's log: it drained, then handed what was left to the draft
    text = two.verifiers[i].log_text()
    assert "verifier_draining" in text and "verifier_drained" in text
    two.verifiers[i] = two.start_verifier(i)
    two.wait_connected(i)
