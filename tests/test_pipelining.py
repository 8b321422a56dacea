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
from specwire.launch import scrape_metric

from tiny_models import greedy_continuation

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from delay_proxy import LinkShape, ProxyThread  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43], [100, 7, 3, 9, 11], [60, 61, 2]]


@pytest.fixture(scope="module")
def drafts(text_stack):
    """(plain draft address, pipelined draft address, pipelined draft's metrics URL), both reaching the verifier
    through a 2 ms RTT proxy. The pipelined draft's width is fixed at 3 branches and its k fixed: learned, either
    could fall to 0 on this loaded machine, and then these tests would not exercise pipelining
    (tests/test_goodput_e2e.py runs a pipelined draft under --speculation auto)."""
    with ProxyThread(text_stack.verifier, LinkShape(delay_s=0.001)) as proxy:
        plain, _ = text_stack.start_draft("draft-plain", verifier=proxy.address)
        pipelined, metrics = text_stack.start_draft("draft-pipelined", ["--pipeline", "--pipeline-width", "3",
                                                                      "--speculation", "fixed"],
                                                  verifier=proxy.address)
        yield plain.address, pipelined.address, metrics
        for service in (plain, pipelined):
            text_stack.stop_service(service)


def _pipelined_count(url: str, outcome: str) -> float:
    return scrape_metric(url, "specwire_draft_pipelined_proposals_total", {"outcome": outcome}) or 0.0


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
    for part in ("draft", "network", "verify"):
        assert scrape_metric(metrics, "specwire_draft_round_seconds_count", {"part": part}) > 0, part
    verifier = urllib.request.urlopen(text_stack.metrics_url, timeout=5).read().decode()
    assert re.search(r'^specwire_stream_scheduled_tokens_total\{stream="\d+"\} [1-9]', verifier, re.M)
    assert scrape_metric(text_stack.metrics_url, "specwire_token_budget_fairness") is not None


def test_coupled_seeded_output_is_the_target_alone_output_with_pipelining(drafts):
    """Coupled wire mode, asked per request: the pipelined draft's seeded output is the plain draft's k = 0
    output, and pipelined proposals were used along the way."""
    plain, pipelined, metrics = drafts
    requests = [dict(prompt_token_ids=p, max_tokens=24, temperature=0.9, seed=31 + i, ignore_eos=True,
                     wire_mode="coupled") for i, p in enumerate(PROMPTS)]
    reference = asyncio.run(_generate_all(plain, [dict(r, num_speculative_tokens=0) for r in requests]))
    used_before = _pipelined_count(metrics, "used")
    assert asyncio.run(_generate_all(pipelined, requests)) == reference
    assert _pipelined_count(metrics, "used") > used_before
