"""Token trees end to end through real gRPC servers on loopback (services on threads of the test process): greedy
output equal to target-only greedy for trees of several shapes beside a chain draft on the same verifier, with
pipelining; coupled output the same with and without trees; sampled output following the target's distribution
in the sparse and one-hot modes; and a draft that grows trees larger than its verifier takes refused clearly."""

from __future__ import annotations

import asyncio

import pytest
import torch

import specwire
from specwire.launch import scrape_metric

from distributions import STAT_VOCAB, assert_first_two_tokens_follow_the_target
from stacks import start_stack
from tiny_models import build_model, greedy_continuation, make_text_pair, model_config, perturbed, save, word_tokenizer

TREES = {"b2-n8": ["--tree-branches", "2", "--tree-nodes", "8"],
         "b3-n16": ["--tree-branches", "3", "--tree-nodes", "16"]}


def _start_draft(running, extra: list[str], metrics: dict[str, str], name: str) -> str:
    """Another draft service on the stack's verifier (the stack's draft arguments, fixed k = 4): its address (its
    metrics URL goes into `metrics`)."""
    service, metrics[name] = running.start_draft("draft", extra)
    return service.address


@pytest.fixture(scope="module")
def tree_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("trees")
    target, draft = make_text_pair(d, "qwen2")
    running = start_stack(target, draft, d / "logs", extra_draft=["--speculation", "fixed"], in_process=True)
    running.tree_metrics = {}
    drafts = {name: _start_draft(running, args, running.tree_metrics, name) for name, args in TREES.items()}
    # pipelined with a fixed width: branches are drafted every round, so some verdicts confirm one
    drafts["b2-n8-pipelined"] = _start_draft(running, [*TREES["b2-n8"], "--pipeline", "true", "--pipeline-width", "3"],
                                             running.tree_metrics, "b2-n8-pipelined")
    # trees ranked by the draft's raw probabilities: the same output, and no calibration learned
    drafts["b2-n8-raw"] = _start_draft(running, [*TREES["b2-n8"], "--tree-calibration", "false"],
                                       running.tree_metrics, "b2-n8-raw")
    yield running, drafts
    running.stack.stop()


PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], [7, 7, 12, 30, 31, 90, 3]]


def test_greedy_trees_equal_target_only_beside_a_chain_draft(tree_stack):
    running, drafts = tree_stack
    n = 40

    async def run_all():
        jobs = []
        clients = [specwire.AsyncClient(a) for a in (running.draft, *drafts.values())]
        for c in clients:
            await c.__aenter__()
        try:
            for c in clients:
                for p in PROMPTS:
                    for k in (2, 4):
                        jobs.append(c.generate(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True,
                                               num_speculative_tokens=k))
            return await asyncio.gather(*jobs)
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)

    results = asyncio.run(run_all())
    expected = [greedy_continuation(running.target_dir, p, n) for p in PROMPTS]
    per_client = len(PROMPTS) * 2
    for c, name in enumerate(["chain", *drafts]):
        accepted = 0
        for i, r in enumerate(results[c * per_client:(c + 1) * per_client]):
            assert list(r.token_ids) == expected[i // 2], (name, i)
            assert len(r.stats.drafted_per_position) <= (2, 4)[i % 2]  # a tree's positions: its depth, k
            accepted += r.stats.num_accepted_tokens
        assert accepted > 0, name
    running.wait_for_metric("specwire_kv_blocks_used", 0)
    # the verdicts calibrated the trees' growth (tree_calibration), except where that is off
    for name, url in running.tree_metrics.items():
        labels = [scrape_metric(url, "specwire_draft_tree_labels_total", {"kind": "greedy", "outcome": outcome})
                  for outcome in ("accepted", "rejected")]
        if name.endswith("-raw"):
            assert labels == [None, None], name
        else:
            assert labels[0] > 0 and labels[1] > 0, (name, labels)


def test_trees_yield_more_tokens_per_round_than_the_chain(tree_stack):
    """The same draft model, the same depth: a tree's round keeps alternatives, so it accepts at least as much."""
    running, drafts = tree_stack
    url = running.tree_metrics["b3-n16"]

    def trees(shape: str) -> float:
        return scrape_metric(url, "specwire_draft_tree_proposals_total", {"pipelined": "false", "shape": shape}) or 0
    branched_before = trees("branched")
    per_round = {}
    rounds = {}
    for name, address in [("chain", running.draft), ("b3-n16", drafts["b3-n16"])]:
        with specwire.Client(address) as client:
            rs = [client.generate(prompt_token_ids=p, max_tokens=48, temperature=0.0, ignore_eos=True,
                                  num_speculative_tokens=4) for p in PROMPTS]
        rounds[name] = sum(r.stats.num_rounds for r in rs)
        per_round[name] = sum(r.stats.num_generated_tokens for r in rs) / rounds[name]
    assert per_round["b3-n16"] >= per_round["chain"], per_round
    # depth 4 and 16 nodes: every round's tree branches (the counter of the trees sent, by shape), but a request's
    # last two at most: greedy, it drafts nothing past max_tokens, so with two tokens left its round is a chain
    # of one draft (a tree needs k > 1), and with one left it drafts nothing
    sent = trees("branched") - branched_before
    assert rounds["b3-n16"] - 2 * len(PROMPTS) <= sent <= rounds["b3-n16"] and not trees("chain")


def test_coupled_output_is_the_same_with_and_without_trees(tree_stack):
    running, drafts = tree_stack
    seeds = [3, 77, 2026]
    outputs = {}
    for name, address in [("chain", running.draft), *drafts.items()]:
        with specwire.Client(address) as client:
            outputs[name] = [client.generate(prompt_token_ids=PROMPTS[0], max_tokens=24, temperature=0.9, seed=s,
                                             ignore_eos=True, wire_mode="coupled").token_ids for s in seeds]
    with specwire.Client(running.draft) as client:
        alone = [client.generate(prompt_token_ids=PROMPTS[0], max_tokens=24, temperature=0.9, seed=s,
                                 ignore_eos=True, wire_mode="coupled", num_speculative_tokens=0).token_ids
                 for s in seeds]
    for name, out in outputs.items():
        assert out == alone, name


def test_a_seeded_sparse_tree_gives_the_same_tokens_with_and_without_pipelining(tree_stack):
    """A sparse tree's shape follows the sequence's record of accepted draws; a pipelined branch and a round drafted
    after the verdict read the same verdicts (all but the last before the round), so a seed gives the same
    tokens either way."""
    running, drafts = tree_stack
    url = running.tree_metrics["b2-n8-pipelined"]
    used_before = scrape_metric(url, "specwire_draft_pipelined_proposals_total", {"outcome": "used"}) or 0
    seeds = [5, 41, 2027, 8, 99]
    outputs = {}
    for name in ("b2-n8", "b2-n8-pipelined"):
        with specwire.Client(drafts[name]) as client:
            # depth 8, 8 nodes: the record decides between depth and second draws
            outputs[name] = [client.generate(prompt_token_ids=PROMPTS[2], max_tokens=48, temperature=0.9, seed=s,
                                             ignore_eos=True, wire_mode="sparse", num_speculative_tokens=8)
                             for s in seeds]
    assert [r.token_ids for r in outputs["b2-n8"]] == [r.token_ids for r in outputs["b2-n8-pipelined"]]
    assert min(r.stats.num_rounds for r in outputs["b2-n8"]) >= 4
    assert scrape_metric(url, "specwire_draft_pipelined_proposals_total", {"outcome": "used"}) > used_before


@pytest.fixture(scope="module")
def stat_tree_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stat-trees")
    tok = word_tokenizer(STAT_VOCAB)
    config = model_config("qwen2", STAT_VOCAB, eos_token_id=None, init=0.5)
    target = build_model(config, seed=11, dtype=torch.float64)
    draft = perturbed(target, seed=12, scale=0.6)
    tdir, ddir = save(target, tok, d / "target"), save(draft, tok, d / "draft")
    running = start_stack(tdir, ddir, d / "logs", k=3, in_process=True,
                          extra_draft=["--tree-branches", "3", "--tree-nodes", "8", "--speculation", "fixed"])
    yield running
    running.stack.stop()


# statistics-heavy end to end (the tree rule's own statistics run in the default profile: test_tree_sampler.py)
@pytest.mark.slow
@pytest.mark.parametrize("wire_mode", ["sparse", "one-hot"])
def test_sampled_trees_follow_the_target_distribution(stat_tree_stack, wire_mode):
    """Children drawn without replacement (sparse) or the draft's likeliest (one-hot): the first two tokens
    against the target's exact marginals, the draft's as the negative control (N = 1000, V = 8). Through the
    services this checks the wiring; the rule's power against a subtle bias (children chosen, not drawn) is
    test_tree_sampler's, at N = 40000. One-hot here in the slow profile: test_tree_sampler runs it every time."""
    assert_first_two_tokens_follow_the_target(stat_tree_stack, 1000, wire_mode=wire_mode)


def test_a_verifier_that_takes_smaller_trees_refuses_the_request_clearly(tmp_path):
    target, draft = make_text_pair(tmp_path, "qwen2")
    running = start_stack(target, draft, tmp_path / "logs", in_process=True, extra_verifier=["--max-tree-nodes", "4"],
                          extra_draft=["--tree-branches", "2", "--tree-nodes", "8"])
    try:
        with specwire.Client(running.draft) as client, pytest.raises(specwire.FailedPreconditionError,
                                                                     match="--tree-nodes"):
            client.generate(prompt_token_ids=[5, 9], max_tokens=4, temperature=0.0)
    finally:
        running.stack.stop()
