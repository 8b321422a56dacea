"""--quantization int8 and int4 on both services: the quantized model is the target, and speculation stays lossless
against it (greedy identical to k = 0 with the same quantization, coupled sampling identical to its k = 0)."""

from __future__ import annotations

import json

import pytest
import torch

from specwire.testing import LocalStack, text_pair

from gguf_files import gguf_source

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43]]


# int4-gguf in every run: it maps GGUF Q4 blocks as they are and runs the int4 kernels. int8 and the requantized
# int4 differ only in how the weights are made (test_paged_model checks both against the fake-quantized model
# in-process in every run), so their runs through the services are in the slow profile.
@pytest.fixture(scope="module", params=[pytest.param("int8", marks=pytest.mark.slow),
                                        pytest.param("int4", marks=pytest.mark.slow), "int4-gguf"])
def quantized(request, tmp_path_factory):
    """int4-gguf: both models are conversions of Q4_0 GGUF files, whose blocks the services map as they are."""
    root = tmp_path_factory.mktemp(request.param)
    target, draft = text_pair(root, "qwen2", dtype=torch.float32)
    if request.param == "int4-gguf":
        gguf_source(target)
        gguf_source(draft)
    flags = ("--quantization", request.param.split("-")[0])
    # a fixed k: the point is speculation against the quantized target (auto may choose k = 0 for this tiny pair)
    with LocalStack.start(target, draft, log_dir=root / "logs", verifier_args=flags,
                          draft_args=(*flags, "--speculation", "fixed")) as stack:
        if request.param == "int4-gguf":
            for service in ("verifier", "draft"):
                mapped = [json.loads(line) for line in (root / "logs" / f"{service}.log").read_text().splitlines()
                          if "gguf_int4_mapping" in line]
                assert mapped and mapped[0]["exact"] == 2 * 7 + 1 and mapped[0]["requantized"] == 0, mapped
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
