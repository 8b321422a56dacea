"""The GPU code path end to end on CPU: both services run with SPECWIRE_KERNELS=triton under TRITON_INTERPRET=1,
so every attention, KV write, sampling-probability and rejection-sampling call goes through the Triton kernels
(the torch references raise if called), with float32 tiny models.

bench/gpu_check.py runs the same tests on a GPU with SPECWIRE_TEST_DEVICE=cuda: `--device cuda`, compiled
kernels, no interpreter."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import specwire

from distributions import STAT_VOCAB, assert_first_two_tokens_follow_the_target
from stacks import start_stack
from tiny_models import build_model, greedy_continuation, make_text_pair, model_config, perturbed, save, word_tokenizer

DEVICE = os.environ.get("SPECWIRE_TEST_DEVICE", "cpu")
TRITON_ENV = {"SPECWIRE_KERNELS": "triton", **({"TRITON_INTERPRET": "1"} if DEVICE == "cpu" else {})}
# bench/gpu_check.py runs the module three times on a GPU: eagerly (0), with graphs captured and replayed (1), and
# unset, where the services choose (graphs on a CUDA GPU, none on the CPU)
GRAPHS = {"1": ["--cuda-graphs", "true"], "0": ["--cuda-graphs", "false"]}.get(
    os.environ.get("SPECWIRE_TEST_CUDA_GRAPHS", ""), [])


def _stack(target, draft, log_dir, *, k=4):
    # block size 16: the Triton attention walks whole pages of a power-of-two size >= 16
    return start_stack(target, draft, log_dir, k=k, dtype="float32", block_size=16, env=TRITON_ENV,
                       extra_verifier=["--device", DEVICE, *GRAPHS], extra_draft=["--device", DEVICE, *GRAPHS])


@pytest.fixture(scope="module")
def triton_stack(models_dir):
    target, draft = make_text_pair(models_dir / "triton", "qwen2", dtype=torch.float32)
    running = _stack(target, draft, models_dir / "logs-triton")
    yield running
    running.stack.stop()


def _graphs_expected() -> bool:
    """What the services were asked for, or by default choose: graphs on a CUDA GPU, none on ROCm or the CPU."""
    chosen = os.environ.get("SPECWIRE_TEST_CUDA_GRAPHS", "")
    if chosen in ("0", "1"):
        return chosen == "1"
    return DEVICE.startswith("cuda") and torch.version.hip is None


def _assert_triton_ran(stack):
    for service in stack.stack.services:
        log = service.log_text()
        assert "must not run" not in log, log[-3000:]
        assert ("graphs_captured" in log) == _graphs_expected(), log[-3000:]
    assert stack.metric("specwire_kv_blocks_used") == 0
    # decode-sized steps went through the static device buffers a graph replays (common.static_forward)
    assert stack.metric("specwire_static_steps_total") > 0
    assert stack.metric("specwire_draft_static_steps_total", draft=True) > 0


GREEDY_PROMPTS = ["def fibonacci(n):", "The quick brown fox"]


def _assert_greedy_equals_target_only(stack, draft_address: str, ks: tuple[int, ...], n: int = 12) -> None:
    """Every prompt at every k through `draft_address`, greedy: the target-only continuation, some drafts accepted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.target_dir)

    async def run_all():
        async with specwire.AsyncClient(draft_address) as client:
            return await asyncio.gather(*[client.generate(p, max_tokens=n, temperature=0.0, ignore_eos=True,
                                                          num_speculative_tokens=k)
                                          for p in GREEDY_PROMPTS for k in ks])

    results = asyncio.run(run_all())
    for i, prompt in enumerate(GREEDY_PROMPTS):
        expected = greedy_continuation(stack.target_dir, tok.encode(prompt, add_special_tokens=False), n)
        for j, k in enumerate(ks):
            assert results[len(ks) * i + j].token_ids == expected, f"prompt {prompt!r}, k={k}"
    assert sum(r.stats.num_accepted_tokens for r in results) > 0


def test_greedy_equals_target_only_through_the_triton_path(triton_stack):
    _assert_greedy_equals_target_only(triton_stack, triton_stack.draft, (1, 4))
    _assert_triton_ran(triton_stack)


def test_get_info_names_the_device_platform_and_dtype(triton_stack):
    import grpc

    from specwire.v1 import verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(triton_stack.verifier) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)
    assert info.device.startswith(DEVICE) and info.dtype == "float32" and info.device_name
    assert info.platform == "CPU" if DEVICE == "cpu" else info.platform.startswith(("CUDA", "HIP"))


def test_seeded_sampling_is_reproducible_through_the_triton_path(triton_stack):
    """The sampled paths through the kernels (the sampling-probs kernel, the rejection sampler's sampled branches,
    the draft's sampling), each torch reference made to raise; short requests: the interpreter runs every
    kernel program in Python (28 s of the default run at 10 tokens beside two others, 12 s now)."""
    kwargs = dict(max_tokens=6, temperature=0.9, top_p=0.95, top_k=50, seed=77, ignore_eos=True)
    with specwire.Client(triton_stack.draft) as client:
        alone = client.generate("The quick brown fox", **kwargs)

    async def crowded():
        async with specwire.AsyncClient(triton_stack.draft) as client:
            others = [client.generate("def fibonacci(n):", max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)]
            return (await asyncio.gather(client.generate("The quick brown fox", **kwargs), *others))[0]

    assert asyncio.run(crowded()).token_ids == alone.token_ids
    _assert_triton_ran(triton_stack)


# 20 s of the default run on 2 cores: the tree attention kernel equals dense masked attention in
# tests/test_tree_attention.py, the tree verdict the reference in tests/test_kernels_triton.py; what only this
# covers is a model forward with a tree on the Triton path (attention_metadata's tree, moved to the device)
@pytest.mark.slow
def test_greedy_trees_equal_target_only_through_the_triton_path(triton_stack):
    """Token trees through the kernels: the attention's ancestor masks, the tree verdict in the rejection sampler,
    the accepted path's K and V moved after it; a second draft service drafting trees on the same verifier."""
    from specwire.launch import scrape_metric

    service, metrics = triton_stack.start_draft("tree-draft", ["--tree-branches", "3", "--tree-nodes", "16",
                                                               "--speculation", "fixed"])
    try:
        _assert_greedy_equals_target_only(triton_stack, service.address, (4,))
        branched = scrape_metric(metrics, "specwire_draft_tree_proposals_total", {"shape": "branched",
                                                                                  "pipelined": "false"})
        assert branched and branched > 0  # trees with alternatives were verified, not only chains
        log = service.log_text()
        assert "must not run" not in log, log[-3000:]
    finally:
        triton_stack.stop_service(service)
    triton_stack.wait_for_metric("specwire_kv_blocks_used", 0)
    _assert_triton_ran(triton_stack)


@pytest.fixture(scope="module")
def triton_stat_stack(models_dir):
    tok = word_tokenizer(STAT_VOCAB)
    # one layer, two heads: the interpreter runs one program per (sequence, head) per layer
    config = model_config("qwen2", STAT_VOCAB, eos_token_id=None, init=0.5, hidden=32, layers=1, heads=2, kv_heads=1)
    target = build_model(config, seed=11, dtype=torch.float32)
    draft = perturbed(target, seed=12, scale=0.6)
    tdir = save(target, tok, models_dir / "triton-stat-target")
    ddir = save(draft, tok, models_dir / "triton-stat-draft")
    running = _stack(tdir, ddir, models_dir / "logs-triton-stat", k=3)
    yield running
    running.stack.stop()


# NOTE: 333 s of the default run's 1443 s on 2 cores (the interpreter runs every kernel program in Python), so it
# runs with -m slow. The default run still holds the Triton path to the same promise: the rejection sampler and
# the sampling-probs kernels equal the reference exactly (tests/test_kernels_triton.py), the reference follows the
# target distribution with a negative control (tests/test_rejection_sampler.py, tests/test_e2e.py), and greedy and
# seeded output through the Triton path end to end are checked above (trees with -m slow).
@pytest.mark.slow
def test_sampled_tokens_follow_the_target_through_the_triton_path(triton_stat_stack):
    """As tests/test_e2e.py's statistical test, through the kernels: N = 1000, so TV <= 0.128."""
    assert_first_two_tokens_follow_the_target(triton_stat_stack, 1000)
    _assert_triton_ran(triton_stat_stack)
