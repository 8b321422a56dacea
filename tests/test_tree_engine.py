"""Token trees through the verifier engine: greedy output equal to target-only greedy, alone and batched beside
chains, with trees of several shapes; the K/V after a partly accepted tree equal to a target-only run's over the
accepted tokens; and no block left behind."""

from __future__ import annotations

import random

import pytest
import torch

from common.sampling import SamplingParams
from verifier_service.config import VerifierConfig
from verifier_service.server import build_engine
from verifier_service.types import ErrorOut, OpenCmd, ProposeCmd, SeqKey, VerdictOut

from tiny_models import greedy_continuation, make_text_pair

VOCAB = 200


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("tree-engine"), "qwen2")


def _engine(target, **kwargs):
    config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=6,
                            max_tree_nodes=16, **kwargs)
    return build_engine(config)


def tree_around(rng: random.Random, truth: list[int], num_nodes: int, branches: int, depth: int,
                miss: float = 0.25) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tree whose path of `truth` tokens (the target's own) runs until a random miss, each of its nodes among up
    to `branches` siblings at a random rank, and decoy nodes hung anywhere. (tokens, parents)"""
    tokens: list[int] = []
    parents: list[int] = []
    node, d = -1, 0
    while d < min(depth, len(truth)) and len(tokens) < num_nodes:
        width = rng.randint(1, branches)
        hit = rng.randrange(width) if rng.random() > miss else None
        nxt = None
        for r in range(min(width, num_nodes - len(tokens))):
            tokens.append(truth[d] if r == hit else rng.choice([t for t in range(3, VOCAB) if t != truth[d]]))
            parents.append(node)
            if r == hit:
                nxt = len(tokens) - 1
        if nxt is None:
            break
        node, d = nxt, d + 1
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    while len(tokens) < num_nodes:  # decoys under any node not at the depth limit
        parent = rng.choice([-1] + [i for i in range(len(tokens)) if depths[i] < depth - 1])
        tokens.append(rng.randrange(3, VOCAB))
        parents.append(parent)
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return tuple(tokens), tuple(parents)


def _generate(engine, prompts, n, shapes, *, seed=0, stop_after=None):
    """Greedy generation of n tokens per prompt; sequence i proposes trees of shapes[i] = (nodes, branches), or
    chains of 4 when it is None. Returns the outputs, and the accepted counts per round of the tree sequences."""
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    keys = [SeqKey(1, i) for i in range(len(prompts))]
    oracle = [greedy_continuation(engine_target(engine), p, n + 8) for p in prompts]
    out = {key: [] for key in keys}
    accepted: list[int] = []
    for key, prompt in zip(keys, prompts, strict=True):
        engine.submit(OpenCmd(key, tuple(prompt), greedy.with_seed()))
    pending, done, rounds = set(), set(), 0
    for _ in range(2000):
        for i, key in enumerate(keys):
            if key in done or key in pending:
                continue
            have = len(out[key])
            truth = oracle[i][have:]
            if shapes[i] is None:
                drafts = tuple(truth[:2]) + (7, 7)
                engine.submit(ProposeCmd(key, len(prompts[i]) + have, drafts, None))
            else:
                tokens, parents = tree_around(rng, truth, shapes[i][0], shapes[i][1], depth=6)
                engine.submit(ProposeCmd(key, len(prompts[i]) + have, tokens, None, draft_parents=parents))
            pending.add(key)
        result = engine.step()
        for o in result.outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, VerdictOut):
                pending.discard(o.key)
                out[o.key].extend(o.token_ids)
                if shapes[o.key.seq_id] is not None:
                    accepted.append(o.num_accepted)
                if o.finish_reason:
                    done.add(o.key)
        rounds += 1
        if len(done) == len(keys) or (stop_after is not None and rounds >= stop_after and not pending):
            return [out[k] for k in keys], accepted, oracle
    raise AssertionError("generation did not finish")


_TARGETS: dict[int, str] = {}


def engine_target(engine):
    return _TARGETS[id(engine)]


@pytest.mark.parametrize("nodes,branches", [(8, 2), (16, 2), (8, 3), (16, 3)])
def test_greedy_trees_equal_target_only_greedy(pair, nodes, branches):
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    _TARGETS[id(engine)] = target
    prompts = [[5, 9, 11, 4, 8], [17, 3, 3, 60]]
    outputs, accepted, oracle = _generate(engine, prompts, 20, [(nodes, branches), (nodes, branches)],
                                          seed=nodes * branches)
    for out, expected in zip(outputs, oracle, strict=True):
        assert out == expected[:20]
    assert max(accepted) >= 2  # paths through the trees were accepted, not only bonus tokens
    assert engine.blocks.num_used_blocks == 0


def test_a_tree_of_more_nodes_than_max_draft_tokens_is_verified_whole(pair):
    """--max-draft-tokens bounds a tree's depth, not its nodes (--tree-nodes does): a 16-node tree of depth 6
    is verified with every node."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [5, 9, 11, 4, 8]
    tokens, parents = tree_around(random.Random(3), greedy_continuation(target, prompt, 8), 16, 3, depth=6)
    key = SeqKey(1, 0)
    engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=20).with_seed()))
    engine.submit(ProposeCmd(key, len(prompt), tokens, None, draft_parents=parents))
    assert engine.step().stats.num_draft_tokens == 16


def test_trees_batched_beside_chains(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=96)
    _TARGETS[id(engine)] = target
    prompts = [[5, 9, 11, 4, 8], [40, 41], [7, 7, 7, 12, 30, 31], [90, 3]]
    outputs, _, oracle = _generate(engine, prompts, 16, [(16, 3), None, (8, 2), None], seed=5)
    for out, expected in zip(outputs, oracle, strict=True):
        assert out == expected[:16]
    assert engine.blocks.num_used_blocks == 0


def _cached_kv(engine, key, n):
    slots = torch.tensor(engine.blocks.slots(key, 0, n))
    cache = engine.runner.model.kv_cache
    return [c.view(-1, *c.shape[2:])[slots].clone() for c in (*cache.key_caches, *cache.value_caches)]


def test_kv_after_a_partly_accepted_tree_equals_a_target_only_run(pair):
    target, _ = pair
    prompt = [5, 9, 11, 4, 8, 21, 13]
    tree_engine, plain_engine = _engine(target, num_blocks=64), _engine(target, num_blocks=64)
    _TARGETS[id(tree_engine)] = _TARGETS[id(plain_engine)] = target
    key = SeqKey(1, 0)
    outputs, accepted, _ = _generate(tree_engine, [prompt], 40, [(16, 3)], seed=9, stop_after=4)
    assert any(0 < a for a in accepted)
    seq = tree_engine.scheduler.sequences[key]
    # the target alone over the same tokens: plain decoding, one token per step
    plain, _, _ = _generate(plain_engine, [prompt], len(outputs[0]), [None], seed=9)
    assert plain[0] == outputs[0]
    n = seq.num_cached
    plain_seq_key = SeqKey(1, 0)
    # the plain run has finished (and freed its blocks): recompute its cache with one more open of the same tokens
    plain_engine.submit(OpenCmd(plain_seq_key, tuple(prompt + outputs[0]), SamplingParams(temperature=0.0,
                                                                                          max_tokens=4).with_seed()))
    plain_engine.step()
    while plain_engine.scheduler.sequences[plain_seq_key].needs_prefill:
        plain_engine.step()
    assert n > len(prompt)
    for tree_kv, plain_kv in zip(_cached_kv(tree_engine, key, n), _cached_kv(plain_engine, plain_seq_key, n),
                                 strict=True):
        torch.testing.assert_close(tree_kv, plain_kv, atol=1e-9, rtol=1e-9)


def test_malformed_trees_are_refused_with_a_readable_reason():
    from common.errors import ErrorCode, ServiceError
    from verifier_service.validation import Limits, check_proposal

    limits = Limits(vocab_size=100, max_model_len=64, max_draft_tokens=3, max_q_support=8, max_tree_nodes=6)
    key = SeqKey(1, 1)

    def refused(tokens, parents, limits=limits):
        with pytest.raises(ServiceError) as err:
            check_proposal(ProposeCmd(key, 5, tokens, None, draft_parents=parents), limits)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
        return err.value.message

    assert "earlier draft token" in refused((4, 5, 6), (-1, 1, 0))  # its own parent
    assert "earlier draft token" in refused((4, 5, 6), (-1, -2, 0))
    assert "earlier draft token" in refused((4, 5), (1, -1))  # a parent after its child
    assert "4 tokens deep" in refused((4, 5, 6, 7), (-1, 0, 1, 2))
    assert "at most 6" in refused(tuple(range(3, 10)), (-1,) * 7)
    assert "draft_parents" in refused((4, 5, 6), (-1, 0))
    assert "chains only" in refused((4, 5), (-1, -1), Limits(100, 64, 3, 8))
    wide = Limits(vocab_size=100, max_model_len=64, max_draft_tokens=3, max_q_support=8, max_tree_nodes=20)
    assert "more than 16 children" in refused(tuple(range(3, 20)), (-1,) * 17, wide)
    check_proposal(ProposeCmd(key, 5, (4, 5, 6, 7, 8, 9), None, draft_parents=(-1, -1, 0, 0, 1, 4)), limits)


def test_a_tree_past_the_context_keeps_its_first_nodes():
    """Its nodes occupy cache slots past the verified tokens: no more of them than the context has room for."""
    cmd = ProposeCmd(SeqKey(1, 1), 5, (4, 5, 6, 7, 8, 9), None, draft_parents=(-1, -1, 0, 0, 1, 4))
    cut = cmd.truncated(4)
    assert cut.draft_token_ids == (4, 5, 6, 7) and cut.draft_parents == (-1, -1, 0, 0)
    assert cut.num_positions == 2
    assert cmd.truncated(0).num_draft_tokens == 0 and cmd.truncated(0).draft_parents is None


def test_a_tree_near_the_end_of_the_context_is_verified_within_it(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=256)
    prompt = [3 + (i * 7) % 150 for i in range(505)]  # the tiny config's context is 512: 7 tokens of room
    key = SeqKey(1, 0)
    engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=64).with_seed()))
    truth = greedy_continuation(target, prompt, 7)
    out: list[int] = []
    rng = random.Random(1)
    for _ in range(50):
        if key not in engine.scheduler.sequences and out:
            break
        if key not in engine.scheduler.sequences or not engine.scheduler.sequences[key].proposals:
            tokens, parents = tree_around(rng, truth[len(out):], 16, 3, depth=6, miss=0.0)
            engine.submit(ProposeCmd(key, len(prompt) + len(out), tokens, None, draft_parents=parents))
        for o in engine.step().outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, VerdictOut):
                out.extend(o.token_ids)
    assert out == truth  # up to the context's end, and not past it
    assert engine.blocks.num_used_blocks == 0
