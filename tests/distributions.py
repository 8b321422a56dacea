"""The end-to-end statistical check: the first two tokens sampled through both services against the target's exact
marginals, with the draft's own marginals as the negative control (test_e2e, test_e2e_triton)."""

from __future__ import annotations

import asyncio
import math

import torch
from transformers import AutoModelForCausalLM

import specwire

STAT_VOCAB = 8  # the statistical pairs' vocabulary: small enough to enumerate p(x1) and p(x2) exactly


def exact_two_token_marginals(model_dir, prompt: list[int], vocab: int = STAT_VOCAB):
    """(p(x1), p(x2), p(x2 | x1)) of a small-vocabulary model, in float64."""
    # transformers' grouped expert matmul (MoE) has no float64 kernel; its loop does
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2_given = torch.stack([model(torch.tensor([prompt + [t]])).logits[0, -1].softmax(-1)
                                for t in range(vocab)])
    return p1, p1 @ p2_given, p2_given


def generate_many(draft_address: str, n: int, **kwargs) -> list[specwire.Result]:
    """n generations with seeds 0..n-1 at temperature 1, 48 at a time."""
    async def run():
        async with specwire.AsyncClient(draft_address) as client:
            sem = asyncio.Semaphore(48)

            async def one(seed):
                async with sem:
                    return await client.generate(temperature=1.0, seed=seed, ignore_eos=True, **kwargs)
            return await asyncio.gather(*[one(s) for s in range(n)])

    return asyncio.run(run())


def sample_first_two_tokens(draft_address: str, prompt: list[int], n: int, **kwargs) -> torch.Tensor:  # [n, 2]
    return torch.tensor([r.token_ids for r in generate_many(draft_address, n, prompt_token_ids=prompt, max_tokens=2,
                                                            **kwargs)])


def assert_first_two_tokens_follow_the_target(stack, n: int, vocab: int = STAT_VOCAB,
                                              prompt: tuple[int, ...] = (1, 5, 2), **kwargs) -> None:
    """The first two sampled tokens (through both services) against the target's exact marginals. Bound: for V
    outcomes and N samples, E[TV] <= 0.5 sqrt(V/N) and P(TV > E + t) <= exp(-2 N t^2), with t for 1e-6. Power:
    the same samples must be further than that from the draft's own marginals (the negative control)."""
    prompt = list(prompt)
    bound = 0.5 * math.sqrt(vocab / n) + math.sqrt(math.log(1e6) / (2 * n))
    p1, p2, _ = exact_two_token_marginals(stack.target_dir, prompt, vocab)
    q1, _, _ = exact_two_token_marginals(stack.draft_dir, prompt, vocab)
    tokens = sample_first_two_tokens(stack.draft, prompt, n, **kwargs)
    emp1 = torch.bincount(tokens[:, 0], minlength=vocab).double() / n
    emp2 = torch.bincount(tokens[:, 1], minlength=vocab).double() / n
    tv = [0.5 * float((emp1 - p1).abs().sum()), 0.5 * float((emp2 - p2).abs().sum())]
    assert max(tv) <= bound, (tv, bound)
    control = 0.5 * float((emp1 - q1).abs().sum())
    assert control > bound, f"the test could not tell the draft's distribution apart: {control} <= {bound}"
    stack.wait_for_metric("specwire_kv_blocks_used", 0)
