"""--quantization int8 and int4 on both services: the quantized model is the target, and speculation stays lossless
against it (greedy identical to k = 0 with the same quantization, coupled sampling identical to its k = 0)."""

from __future__ import annotations

import pytest
import torch

from specwire.testing import LocalStack, text_pair

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43]]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target, draft = text_pair(root, "qwen2", dtype=torch.float32)
    flags = ("--quantization", request.param)
    with LocalStack.start(target, draft, log_dir=root / "logs", verifier_args=flags, draft_args=flags) as stack:
        yield stack


def test_speculation_is_lossless_against_the_quantized_target(quantized):
    with quantized.client() as client:
        for prompt in PROMPTS:
            def run(k, prompt=prompt, **kw):
                return client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True,
                                       num_speculative_tokens=k, **kw)

            greedy = run(0, temperature=0.0).token_ids
            for k in (1, 4):
                spec = run(k, temperature=0.0)
                assert spec.token_ids == greedy, (prompt, k)
                assert spec.stats.num_accepted_tokens > 0
            coupled = dict(temperature=0.9, seed=3, wire_mode="coupled")
            assert run(4, **coupled).token_ids == run(0, **coupled).token_ids
