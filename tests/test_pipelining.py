"""Pipelined drafting: a second draft service with --pipeline on the same verifier drafts the next block while
a verdict is in flight. Greedy and seeded sampled outputs are those of the plain draft service token for token;
pipelined proposals are used when the guess holds and dropped (as normal flow) when it does not. Through a
delay proxy, so verdicts are in flight long enough for drafting ahead to finish first."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from specwire import AsyncClient
from specwire.launch import free_port

from tiny_models import greedy_continuation

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from delay_proxy import LinkShape, ProxyThread  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43], [100, 7, 3, 9, 11], [60, 61, 2]]


def _with_metrics_port(args: list[str], port: int) -> list[str]:
    i = args.index("--metrics-port")
    return [*args[:i + 1], str(port), *args[i + 2:]]


@pytest.fixture(scope="module")
def drafts(text_stack):
    """(plain draft address, pipelined draft address, pipelined draft's metrics URL), both reaching the verifier
    through a 2 ms RTT proxy."""
    services = []
    with ProxyThread(text_stack.verifier, LinkShape(delay_s=0.001)) as proxy:
        args = [a if a != text_stack.verifier else proxy.address for a in text_stack.draft_args]
        metrics_port = free_port()
        for name, extra, port in (("draft-plain", [], free_port()), ("draft-pipelined", ["--pipeline"], metrics_port)):
            services.append(text_stack.stack.start(name, [*_with_metrics_port(args, port), *extra],
                                                   log_dir=text_stack.log_dir, timeout_s=120))
        yield services[0].address, services[1].address, f"http://127.0.0.1:{metrics_port}/metrics"
        for service in services:
            service.stop()
            text_stack.stack.services.remove(service)


def _pipelined_count(url: str, outcome: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(rf'^specwire_draft_pipelined_proposals_total{{outcome="{outcome}"}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _generate_all(address: str, requests: list[dict]) -> list[list[int]]:
    async with AsyncClient(address, timeout=120) as client:
        results = await asyncio.gather(*(client.generate(**r) for r in requests))
    return [r.token_ids for r in results]


def test_greedy_output_is_the_same_with_and_without_pipelining(text_stack, drafts):
    plain, pipelined, metrics = drafts
    requests = [dict(prompt_token_ids=p, max_tokens=24, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    used_before = _pipelined_count(metrics, "used")
    with_pipelining = asyncio.run(_generate_all(pipelined, requests))
    assert with_pipelining == asyncio.run(_generate_all(plain, requests))
    assert with_pipelining == [greedy_continuation(text_stack.target_dir, p, 24) for p in PROMPTS]
    assert _pipelined_count(metrics, "used") > used_before  # the pipelined path did run


@pytest.mark.parametrize("k", [2, 4])
def test_seeded_sampled_output_is_the_same_with_and_without_pipelining(drafts, k):
    plain, pipelined, metrics = drafts
    requests = [dict(prompt_token_ids=p, max_tokens=24, temperature=1.0, top_p=0.95, seed=1000 + i,
                     num_speculative_tokens=k, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    dropped_before = _pipelined_count(metrics, "dropped")
    with_pipelining = asyncio.run(_generate_all(pipelined, requests))
    assert with_pipelining == asyncio.run(_generate_all(plain, requests))
    # sampled drafts are rejected often enough that some guesses miss: those proposals were dropped, and the
    # generations went on (dropped proposals are normal flow)
    assert _pipelined_count(metrics, "dropped") > dropped_before


def test_round_time_is_split_into_draft_network_and_verify(text_stack, drafts):
    _, pipelined, metrics = drafts
    asyncio.run(_generate_all(pipelined, [dict(prompt_token_ids=PROMPTS[0], max_tokens=8, temperature=0.0)]))
    text = urllib.request.urlopen(metrics, timeout=5).read().decode()
    for part in ("draft", "network", "verify"):
        m = re.search(rf'^specwire_draft_round_seconds_count{{part="{part}"}} ([0-9.e+-]+)$', text, re.M)
        assert m and float(m.group(1)) > 0, part
    verifier = urllib.request.urlopen(text_stack.metrics_url, timeout=5).read().decode()
    assert re.search(r'^specwire_stream_scheduled_tokens_total\{stream="\d+"\} [1-9]', verifier, re.M)
    assert re.search(r"^specwire_token_budget_fairness [0-9.]+$", verifier, re.M)
