"""End to end through real gRPC servers on loopback: a verifier and a draft service (on threads of the test process,
stacks.InProcessStack; tests/test_e2e_triton.py and test_faults.py run them as processes)."""

from __future__ import annotations

import asyncio

import pytest

import specwire

from distributions import assert_first_two_tokens_follow_the_target, exact_two_token_marginals
from tiny_models import greedy_continuation

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Ça va très"]


def test_greedy_equals_target_only_for_every_k_with_concurrent_sequences(text_stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_stack.target_dir)
    n = 24

    async def run_all():
        async with specwire.AsyncClient(text_stack.draft) as client:
            jobs = [client.generate(p, max_tokens=n, temperature=0.0, num_speculative_tokens=k, ignore_eos=True)
                    for p in PROMPTS for k in (0, 1, 4, 8)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_continuation(text_stack.target_dir, tok.encode(prompt, add_special_tokens=False), n)
        for j, k in enumerate((0, 1, 4, 8)):
            r = results[i * 4 + j]
            assert r.token_ids == expected, f"prompt {prompt!r}, k={k}"
            assert r.stats.num_generated_tokens == n and r.finish_reason == "length"
            if k:
                accepted += r.stats.num_accepted_tokens
                assert len(r.stats.drafted_per_position) <= k
            else:
                assert r.stats.num_rounds == n and r.stats.num_draft_tokens == 0
    assert accepted > 0, "the draft never agreed: the accept path went untested"
    assert text_stack.metric("specwire_kv_blocks_used") == 0


def test_streaming_text_and_stop_strings(text_stack):
    with specwire.Client(text_stack.draft) as client:
        full = client.generate("def fibonacci(n):", max_tokens=20, temperature=0.0, ignore_eos=True)
        chunks = list(client.stream("def fibonacci(n):", max_tokens=20, temperature=0.0, ignore_eos=True))
        assert "".join(c.text for c in chunks) == full.text
        assert [t for c in chunks for t in c.token_ids] == full.token_ids
        stop = full.text[len(full.text) // 2:][:3]
        cut = client.generate("def fibonacci(n):", max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"


def test_stop_strings_end_tokens_text_and_counts_at_the_same_place_for_every_k(text_stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_stack.target_dir)
    kwargs = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    with specwire.Client(text_stack.draft) as client:
        full = client.generate("def fibonacci(n):", num_speculative_tokens=0, **kwargs)
        tail = full.text[len(full.text) // 3:]
        stop = next(tail[i:i + 2] for i in range(len(tail) - 1) if "\ufffd" not in tail[i:i + 2])
        cuts = {k: client.generate("def fibonacci(n):", stop=[stop], num_speculative_tokens=k, **kwargs)
                for k in (0, 1, 4, 8)}
    for k, cut in cuts.items():
        assert cut.token_ids == cuts[0].token_ids and cut.text == cuts[0].text, f"k={k}"
        assert cut.stats.num_generated_tokens == len(cut.token_ids) and cut.finish_reason == "stop"
    ids = cuts[0].token_ids
    assert ids == full.token_ids[:len(ids)]
    # the tokens end with the one that completed the stop string; the text ends before it
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1]).rstrip("\ufffd")
    assert cuts[0].text == full.text[:full.text.index(stop)]


def test_a_tiny_temperature_is_greedy_and_harms_no_neighbour(text_stack):
    """temperature=1e-45 used to overflow the logits to NaN and fail every request drafted beside it."""
    async def run():
        async with specwire.AsyncClient(text_stack.draft) as client:
            return await asyncio.gather(
                client.generate("The quick brown fox", max_tokens=10, temperature=1e-45, ignore_eos=True),
                *[client.generate(p, max_tokens=10, temperature=0.8, seed=i, ignore_eos=True)
                  for i, p in enumerate(PROMPTS)])

    tiny, *others = asyncio.run(run())
    with specwire.Client(text_stack.draft) as client:
        greedy = client.generate("The quick brown fox", max_tokens=10, temperature=0.0, ignore_eos=True)
    assert tiny.token_ids == greedy.token_ids
    assert all(o.stats.num_generated_tokens == 10 for o in others)


def test_same_seed_same_output_whatever_runs_beside_it(text_stack):
    kwargs = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    with specwire.Client(text_stack.draft) as client:
        alone = client.generate("The quick brown fox", **kwargs)

    async def crowded():
        async with specwire.AsyncClient(text_stack.draft) as client:
            others = [client.generate(p, max_tokens=15, temperature=1.0, seed=i, ignore_eos=True,
                                      num_speculative_tokens=1 + i % 4) for i, p in enumerate(PROMPTS * 2)]
            mine = client.generate("The quick brown fox", **kwargs)
            return (await asyncio.gather(mine, *others))[0]

    assert asyncio.run(crowded()).token_ids == alone.token_ids
    with specwire.Client(text_stack.draft) as client:
        again = client.generate("The quick brown fox", **kwargs)
        other_seed = client.generate("The quick brown fox", **{**kwargs, "seed": 99})
    assert again.token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


# The end-to-end runs check the path through both services (q on the wire, positions, keys), not the sampler's
# exactness to the last percent, which test_rejection_sampler checks in-process with 10^5 samples per mode. So N
# is sized by the power the check needs: this pair's first-token marginals are 0.85 apart in TV, and at N = 1000
# (V = 8) the bound is 0.045 + 0.083 = 0.128, so the negative control (the draft's own marginals) is at least
# 0.85 - 0.128 > 0.128 away from any run within the bound, and a wire bug that moves the output a quarter of the
# way towards the draft fails it. The slow profile runs the other wire paths at N = 3000 (bound 0.074).
N_DEFAULT, N_SLOW = 1000, 3000


def test_sampled_tokens_follow_the_target_distribution(stat_stack):
    """k = 3, sparse q, N = 1000 and V = 8: TV <= 0.128."""
    p1, _, _ = exact_two_token_marginals(stat_stack.target_dir, [1, 5, 2])
    q1, _, _ = exact_two_token_marginals(stat_stack.draft_dir, [1, 5, 2])
    assert 0.5 * float((p1 - q1).abs().sum()) > 2 * 0.128, "draft too close to the target for a negative control"
    assert_first_two_tokens_follow_the_target(stat_stack, N_DEFAULT)


@pytest.mark.slow
def test_coupled_tokens_follow_the_target_distribution(stat_stack):
    """The coupled wire mode, same test (k = 3, N = 3000: TV <= 0.074). Its negative control, a verifier that
    emits the draft's token at a mismatch, is test_rejection_sampler's, which also checks coupled exactness in
    every run."""
    assert_first_two_tokens_follow_the_target(stat_stack, N_SLOW, wire_mode="coupled")


# Pinned on purpose: a change to the random key derivation, the Philox generator, the draft's sampling or the
# rejection sampler changes these tokens. If such a change is intended, update them in the same commit.
GOLDEN_SEEDED = {0: [0, 0, 0, 0, 1, 7, 6, 0, 3, 4, 7, 1], 3: [2, 0, 2, 2, 2, 2, 2, 2, 7, 2, 7, 1]}


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_output_is_pinned(stat_stack, k):
    with specwire.Client(stat_stack.draft) as client:
        out = client.generate(prompt_token_ids=[1, 5, 2], max_tokens=12, temperature=0.9, top_p=0.95, seed=20261130,
                              ignore_eos=True, num_speculative_tokens=k)
        # coupled: k = 0's tokens at every k
        coupled = client.generate(prompt_token_ids=[1, 5, 2], max_tokens=12, temperature=0.9, top_p=0.95,
                                  seed=20261130, ignore_eos=True, num_speculative_tokens=k, wire_mode="coupled")
    assert out.token_ids == GOLDEN_SEEDED[k], repr(list(out.token_ids))
    assert coupled.token_ids == GOLDEN_SEEDED[0], repr(list(coupled.token_ids))


def test_shared_prompt_prefix_is_served_from_the_cache(text_stack):
    system = "You are a careful Python programmer. Answer with code only. " * 3
    before = text_stack.metric("specwire_prefix_cache_hit_tokens_total")
    with specwire.Client(text_stack.draft) as client:
        a = client.generate(system + "def fibonacci(n):", max_tokens=6, temperature=0.0, ignore_eos=True)
        b = client.generate(system + "import numpy as np", max_tokens=6, temperature=0.0, ignore_eos=True)
    assert a.stats.num_generated_tokens == b.stats.num_generated_tokens == 6
    hits = text_stack.metric("specwire_prefix_cache_hit_tokens_total") - before
    assert hits >= 16, f"the second request recomputed the shared prompt ({hits} cached tokens)"


@pytest.fixture(scope="module")
def truncating_draft(stat_stack):
    """A second draft service on the statistical stack's verifier that keeps only the 3 most probable of the 8
    tokens of q (--q-max-support 3): sparse truncation is what gets tested."""
    service, _ = stat_stack.start_draft("draft-truncating", ["--q-max-support", "3"])
    yield service.address
    stat_stack.stop_service(service)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_when_q_is_truncated(stat_stack, truncating_draft):
    """q truncated to 3 of 8 tokens and renormalised, as sent: still the target's distribution (N = 3000). Every
    run checks the truncation itself in-process (test_pipelined_drafting's limited-q test)."""
    from dataclasses import replace

    assert_first_two_tokens_follow_the_target(replace(stat_stack, draft=truncating_draft), N_SLOW)
