"""specwire.testing itself: table models compute exactly their table, an acceptance pair is accepted at the rate
it was built for (through the services), a scripted text must be unambiguous, and bad tables are refused."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specwire import AsyncClient
from specwire.testing import LocalStack, acceptance_pair, table_distribution, table_model, text_model

from stacks import start_stack


def test_a_table_model_computes_its_table(tmp_path):
    g = torch.Generator().manual_seed(0)
    table = torch.rand(24, 24, generator=g, dtype=torch.float64) ** 3
    table[:, 5] = 0.0  # a probability-0 token
    table /= table.sum(1, keepdim=True)
    path = table_model(tmp_path / "m", table, dtype=torch.float64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        probs = model(torch.tensor([[3, 17, 9, 9, 0]])).logits[0].softmax(-1)  # context does not matter
    expected = table_distribution(table)[[3, 17, 9, 9, 0]]
    torch.testing.assert_close(probs, expected, atol=1e-9, rtol=1e-7)
    assert float(probs[:, 5].max()) < 1e-25


@pytest.mark.parametrize("bad,fragment", [
    (torch.ones(4, 5) / 5, "[vocab, vocab]"),
    (torch.full((4, 4), 0.3), "probability vector"),
    (torch.tensor([[1.5, -0.5], [0.5, 0.5]]), "probability vector"),
])
def test_bad_tables_are_refused(tmp_path, bad, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        table_model(tmp_path / "bad", bad)


def test_a_scripted_text_must_not_repeat_a_piece(tmp_path):
    with pytest.raises(ValueError, match="appear once"):
        text_model(tmp_path / "t", "to be or not to be")


def test_an_acceptance_pair_is_accepted_at_its_rate(tmp_path):
    """Sampled at temperature 1, sparse q: per-token acceptance accepted / (accepted + rejected rounds) within
    4 sigma of the rate built in (each draft is accepted with probability exactly 0.6, independently)."""
    target, draft = acceptance_pair(tmp_path, 0.6)

    async def generate_all(address):
        async with AsyncClient(address) as client:
            return await asyncio.gather(*[client.generate(prompt_token_ids=[1, 2, 3], max_tokens=48, temperature=1.0,
                                                          seed=s, ignore_eos=True) for s in range(16)])

    # the services on threads of this process (the pair is the subject; LocalStack is the restart test's)
    running = start_stack(target, draft, tmp_path / "logs", dtype="float32", in_process=True)
    try:
        results = asyncio.run(generate_all(running.draft))
    finally:
        running.stack.stop()
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    trials = accepted + sum(r.stats.num_rejected_rounds for r in results)
    rate = accepted / trials
    assert abs(rate - 0.6) < 4 * math.sqrt(0.6 * 0.4 / trials), (rate, trials)


def test_the_docs_show_the_example_test_file_as_it_is():
    root = Path(__file__).resolve().parent.parent
    example = (root / "tests" / "test_kit_example.py").read_text().rstrip("\n")
    assert example in (root / "docs" / "testing.md").read_text(), "docs/testing.md's example is stale"


@pytest.mark.slow  # the suite's time: resume after a restart is in the default run through tests/test_faults.py
def test_a_local_stack_survives_a_verifier_restart(tmp_path):
    model = text_model(tmp_path / "m", "Hello world! The answer is 42.")
    with LocalStack.start(model, model, log_dir=tmp_path / "logs") as stack, stack.client() as client:
        before = client.generate("Hello", max_tokens=20, temperature=0.0).text
        stack.kill("verifier")
        stack.restart("verifier")
        assert client.generate("Hello", max_tokens=20, temperature=0.0).text == before == " world! The answer is 42."
