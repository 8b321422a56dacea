"""--speculation auto end to end, through real gRPC servers: one verifier, a draft that follows the verifier's
choice of draft length (the default) and one that drafts a fixed k, both at once, while the load changes from one
stream to a burst and back. Greedy outputs are the target's, and coupled outputs the target-alone outputs for
their seeds, whatever lengths were chosen."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

import specwire

from stacks import start_stack
from tiny_models import greedy_continuation, make_text_pair

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Ça va très", "for i in range(",
           "Once upon a time", "SELECT * FROM", "<html><body>", "x = [1, 2, 3]", "Dear Sir,", "print(", "# TODO"]
N = 20
PHASES = (1, len(PROMPTS), 2)  # streams at once: alone, a burst, then light again


@pytest.fixture(scope="module")
def auto_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput-e2e")
    target, draft = make_text_pair(root, "qwen2")
    running = start_stack(target, draft, root / "logs", in_process=True)  # the draft's default: --speculation auto
    fixed, _ = running.start_draft("draft-fixed", ["--speculation", "fixed"])
    pipelined, _ = running.start_draft("draft-auto-pipelined", ["--pipeline"])
    yield running, fixed.address, pipelined.address
    running.stack.stop()


async def _phases(addresses: dict[str, str], **kwargs) -> dict[str, list[list[int]]]:
    """Every prompt through every draft service, PHASES[i] prompts at a time on each, all services at once."""
    out: dict[str, list[list[int]]] = {name: [] for name in addresses}
    clients = {name: specwire.AsyncClient(address) for name, address in addresses.items()}
    try:
        start = 0
        for width in PHASES:
            batch = PROMPTS[start:start + width] if start < len(PROMPTS) else PROMPTS[:width]
            start += width
            jobs = [(name, clients[name].generate(p, max_tokens=N, ignore_eos=True, seed=1000 + i, **kwargs))
                    for name in addresses for i, p in enumerate(batch)]
            results = await asyncio.gather(*(job for _, job in jobs))
            for (name, _), r in zip(jobs, results, strict=True):
                assert r.stats.num_generated_tokens == N
                out[name].append(r.token_ids)
    finally:
        for client in clients.values():
            await client.close()
    return out


def test_greedy_output_is_the_targets_under_auto_and_fixed_k_while_load_changes(auto_stack):
    running, fixed, pipelined = auto_stack
    chosen_before = running.metric("specwire_draft_length_chosen_count")
    out = asyncio.run(_phases({"auto": running.draft, "fixed": fixed, "auto-pipelined": pipelined},
                              temperature=0.0))
    tok = AutoTokenizer.from_pretrained(running.target_dir)
    prompts = [*PROMPTS, *PROMPTS[:2]][:sum(PHASES)]
    expected = [greedy_continuation(running.target_dir, tok.encode(p, add_special_tokens=False), N) for p in prompts]
    assert out["auto"] == expected
    assert out["fixed"] == expected
    assert out["auto-pipelined"] == expected
    # the auto draft asked, and the verifier chose: every auto round after the first of each request
    assert running.metric("specwire_draft_length_chosen_count") > chosen_before
    assert running.metric("specwire_kv_blocks_used") == 0


def test_coupled_output_is_the_same_under_auto_fixed_k_and_target_only(auto_stack):
    running, fixed, pipelined = auto_stack
    sampled = {"temperature": 0.9, "top_p": 0.95, "wire_mode": "coupled"}
    out = asyncio.run(_phases({"auto": running.draft, "fixed": fixed, "auto-pipelined": pipelined}, **sampled))
    alone = asyncio.run(_phases({"alone": running.draft}, num_speculative_tokens=0, **sampled))
    assert out["auto"] == alone["alone"]
    assert out["fixed"] == alone["alone"]
    assert out["auto-pipelined"] == alone["alone"]
