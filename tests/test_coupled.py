"""Coupled sampling through real services: one seeded request gives the target-alone output (k = 0 with that
seed) for every k, adaptive k, pipelining, a good draft, a random-garbage draft and prompt lookup, with other
traffic running beside it. The verifier restart case lives in test_faults.py (it shares that module's restarts).

Power: the good draft's coupled proposals are mostly accepted (the sameness is not the verifier ignoring them),
and the same request verified by rejection sampling at k = 4 gives other tokens (the invariance is the mode's)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.config import DraftConfig
from specwire import AsyncClient, Client

from sampler_reference import coupled_match_probability
from stacks import start_stack
from tiny_models import build_model, byte_bpe_tokenizer, make_text_pair, model_config, save

PROMPT = [5, 9, 14, 3, 22, 7]
N = 40
SEEDED = dict(prompt_token_ids=PROMPT, max_tokens=N, temperature=0.9, top_p=0.95, seed=777, ignore_eos=True)


@pytest.fixture(scope="module")
def coupled_stack(tmp_path_factory):
    """A verifier and four draft services, all --wire-mode coupled: the default draft, one with adaptive k, one
    whose model is random garbage, and prompt lookup (n-gram)."""
    d = tmp_path_factory.mktemp("coupled")
    target, draft = make_text_pair(d, "qwen2")
    tok = byte_bpe_tokenizer()
    garbage = save(build_model(model_config("qwen2", len(tok), eos_token_id=tok.eos_token_id), seed=99), tok,
                   d / "garbage-draft")
    # the default draft drafts a fixed k (its k = 4 request's bytes per draft token are measured below); the
    # "auto" one follows the verifier's choice of length (the services' default)
    running = start_stack(target, draft, d / "logs", extra_draft=["--wire-mode", "coupled", "--speculation", "fixed"],
                          in_process=True)
    drafts = {"default": running.draft}
    try:
        for name, extra in [("adaptive", ["--speculation", "adaptive"]),
                            ("auto", ["--speculation", "auto"]),
                            ("garbage", ["--model", str(garbage)]),
                            ("ngram", ["--proposer", "ngram"])]:
            service, metrics_url = running.start_draft(name, extra)
            drafts[name] = service.address
            drafts[f"{name}-metrics"] = metrics_url
        yield running, drafts
    finally:
        running.stack.stop()


def test_a_seeded_coupled_output_is_the_target_alone_output(coupled_stack):
    running, drafts = coupled_stack
    with Client(running.draft) as client:
        reference = client.generate(**SEEDED, num_speculative_tokens=0).token_ids
        # k = 0 is plain decoding in every mode: "k = 0 with seed s" is one output
        assert client.generate(**SEEDED, num_speculative_tokens=0, wire_mode="sparse").token_ids == reference
        sparse_k4 = client.generate(**SEEDED, num_speculative_tokens=4, wire_mode="sparse")
    assert len(reference) == N
    assert sparse_k4.token_ids != reference, "rejection sampling at k = 4 should change this seeded output"

    async def crowded():
        runs = [(drafts["default"], dict(num_speculative_tokens=k)) for k in (1, 4, 8)]
        runs += [(drafts[name], {}) for name in ("adaptive", "auto", "garbage", "ngram")]
        async with AsyncClient(drafts["default"]) as other:
            traffic = [other.generate(prompt_token_ids=[3 + i, 8, 1], max_tokens=30, temperature=1.0, seed=i,
                                      ignore_eos=True, num_speculative_tokens=1 + i % 5) for i in range(6)]

            async def one(address, kwargs):
                async with AsyncClient(address) as client:
                    return await client.generate(**SEEDED, **kwargs)

            return await asyncio.gather(*(one(a, kw) for a, kw in runs), *traffic)

    results = asyncio.run(crowded())[:7]
    names = ["k=1", "k=4", "k=8", "adaptive k", "auto", "garbage draft", "ngram"]
    for name, result in zip(names, results, strict=True):
        assert result.token_ids == reference, name
    by_name = dict(zip(names, results, strict=True))
    k4 = by_name["k=4"].stats
    # per-token acceptance (accepted / (accepted + rejected rounds)); about 0.7 expected from (1 - TV) / (1 + TV)
    assert k4.num_accepted_tokens >= k4.num_rejected_rounds, "the good draft's coupled proposals were rejected"
    assert by_name["adaptive k"].stats.num_accepted_tokens > 0
    # coupled proposals carry ids only; sparse ones a q of up to 64 entries per draft token
    coupled_bytes = k4.proposal_bytes / k4.num_draft_tokens
    assert 0 < coupled_bytes < 12, coupled_bytes
    assert sparse_k4.stats.proposal_bytes / sparse_k4.stats.num_draft_tokens > 10 * coupled_bytes
    running.wait_for_metric("specwire_kv_blocks_used", 0)


def _next_token_dists(model_dir, prompt: list[int]) -> torch.Tensor:  # [vocab] float64, temperature 1
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].softmax(-1)


@pytest.mark.parametrize("context", [[], [40], [101, 7]])
def test_coupled_acceptance_is_the_coupling_probability(coupled_stack, context):
    """One drafted position (k = 1 and max_tokens = 2: the first round verifies one draft, and the second, if any,
    has one token left and drafts nothing, so a request's num_accepted is the match indicator): over
    N seeds the match rate agrees with the exact P(argmax p / E = argmax q / E) within 4 sigma, and is at least
    (1 - TV) / (1 + TV) - 4 sigma. q is the draft's distribution as it races: its top --q-max-support tokens,
    renormalised. Independent noise on the two sides would match with probability sum p q, about 0.1 here."""
    running, _ = coupled_stack
    prompt, n = PROMPT + context, 400
    p = _next_token_dists(running.target_dir, prompt)
    q = _next_token_dists(running.draft_dir, prompt)
    support = DraftConfig.__dataclass_fields__["q_max_support"].default
    q = torch.where(q >= q.topk(support).values[-1], q, torch.zeros_like(q))
    q /= q.sum()
    tv = 0.5 * float((p - q).abs().sum())
    exact = coupled_match_probability(p, q)
    assert exact > 2 * float((p * q).sum()), "too close to independent sampling to tell coupling apart"

    async def run():
        async with AsyncClient(running.draft) as client:
            sem = asyncio.Semaphore(48)

            async def one(seed):
                async with sem:
                    return await client.generate(prompt_token_ids=prompt, max_tokens=2, temperature=1.0, seed=seed,
                                                 num_speculative_tokens=1, ignore_eos=True)
            return await asyncio.gather(*[one(s) for s in range(n)])

    rate = sum(r.stats.num_accepted_tokens for r in asyncio.run(run())) / n
    sigma = math.sqrt(exact * (1 - exact) / n)
    assert abs(rate - exact) < 4 * sigma, (rate, exact, tv)
    assert rate >= (1 - tv) / (1 + tv) - 4 * sigma, (rate, tv)
