"""The verifier's step budget holds whatever the drafts send: a proposal that arrives before its sequence's
prefill is done waits while the prefill runs in chunks, no step exceeds --max-num-batched-tokens, and no
sequence starves. Also: copy-on-write copies only ever belong to scheduled items, and a step in flight when a
stream closes does not bring back that stream's metric series."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.block_manager import BlockManager
from common.sampling import SamplingParams
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import VerifierConfig
from verifier_service.metrics import VerifierMetrics
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import Sequence
from verifier_service.server import build_engine
from verifier_service.types import ErrorOut, OpenCmd, ProposeCmd, SeqKey, VerdictOut

from tiny_models import greedy_continuation, make_text_pair

K = 4  # max_draft_tokens of every engine here: a verification block is K + 1 = 5 tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("budget"), "qwen2")


def _engine(target, **kwargs):
    config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=K, **kwargs)
    return build_engine(config)


def _drive(engine, prompts: dict[SeqKey, list[int]], n: dict[SeqKey, int], oracle: dict[SeqKey, list[int]],
           max_steps=500):
    """Greedy generation of n[key] tokens per sequence; each proposes K drafts from `oracle` as soon as its previous
    verdict is in, so the first proposal goes with the open, long before a long prompt is prefilled. Returns
    the outputs and, per step, (its stats, the keys it gave a verdict, the keys that had a proposal waiting)."""
    out: dict[SeqKey, list[int]] = {key: [] for key in prompts}
    for key, prompt in prompts.items():
        greedy = SamplingParams(temperature=0.0, max_tokens=n[key], ignore_eos=True)
        engine.submit(OpenCmd(key, tuple(prompt), greedy.with_seed()))
    pending: set[SeqKey] = set()
    done: set[SeqKey] = set()
    steps = []
    for _ in range(max_steps):
        for key in prompts:
            if key not in done and key not in pending:
                j = len(out[key])
                engine.submit(ProposeCmd(key, len(prompts[key]) + j, tuple(oracle[key][j:j + K]), None))
                pending.add(key)
        waiting = set(pending)
        result = engine.step()
        verdicts = [o for o in result.outcomes if isinstance(o, VerdictOut)]
        assert not [o for o in result.outcomes if isinstance(o, ErrorOut)]
        steps.append((result.stats, {v.key for v in verdicts}, waiting))
        for v in verdicts:
            pending.discard(v.key)
            out[v.key].extend(v.token_ids)
            if v.finish_reason:
                done.add(v.key)
        if done == set(prompts):
            return out, steps
    raise AssertionError("generation did not finish")


def test_a_proposal_that_arrives_before_its_prefill_is_done_waits_for_the_chunks(pair):
    """A 40-token prompt whose first proposal comes with the open, under a budget of 8 tokens: the prefill
    runs in chunks, every step stays within the budget, a short sequence on another stream keeps getting
    verdicts meanwhile, and the outputs are those of the unchunked run."""
    target, _ = pair
    long, short = SeqKey(1, 0), SeqKey(2, 0)
    prompts = {long: list(range(3, 43)), short: [3, 4, 5]}
    n = {long: 8, short: 40}  # the short one is still generating when the long one's prefill ends
    oracle = {key: greedy_continuation(target, p, n[key] + K) for key, p in prompts.items()}

    engine = _engine(target, num_blocks=64, max_num_batched_tokens=8)
    out, steps = _drive(engine, prompts, n, oracle)
    assert all(stats is not None and stats.num_tokens <= 8 for stats, _, _ in steps), \
        [stats.num_tokens for stats, _, _ in steps if stats]
    first_long = next(i for i, (_, served, _) in enumerate(steps) if long in served)
    assert first_long >= 39 // 8  # the 39 tokens before the last were fed 8 at most per step
    # meanwhile the short sequence, its proposal waiting in every step, got a verdict in at least every other
    # step (fair turns: its stream is first every other step, and a first item always fits)
    assert all(short in waiting for _, _, waiting in steps[:first_long + 1])
    short_served = [short in served for _, served, _ in steps[:first_long + 1]]
    assert all(a or b for a, b in zip(short_served, short_served[1:], strict=False)), short_served
    assert engine.blocks.num_used_blocks == 0

    unchunked, unchunked_steps = _drive(_engine(target, num_blocks=64), prompts, n, oracle)
    assert max(stats.num_tokens for stats, _, _ in unchunked_steps) > 8  # the same run, not chunked
    assert out == unchunked
    assert all(out[key] == oracle[key][:n[key]] for key in prompts)


def test_a_budget_of_one_verification_block_starves_no_sequence(pair):
    """The smallest budget allowed holds exactly one verification block: long prefills on two streams and a
    short sequence on a third all finish, exactly, and no step exceeds the budget."""
    target, _ = pair
    prompts = {SeqKey(1, 0): list(range(3, 30)), SeqKey(2, 0): list(range(40, 61)), SeqKey(3, 0): [5, 6, 7]}
    n = dict.fromkeys(prompts, 6)
    oracle = {key: greedy_continuation(target, p, 6 + K) for key, p in prompts.items()}
    engine = _engine(target, num_blocks=64, max_num_batched_tokens=K + 1)
    out, steps = _drive(engine, prompts, n, oracle)
    assert all(stats is not None and stats.num_tokens <= K + 1 for stats, _, _ in steps)
    assert all(out[key] == oracle[key][:6] for key in prompts)
    assert engine.blocks.num_used_blocks == 0


def test_a_budget_that_cannot_hold_one_verification_block_is_refused():
    with pytest.raises(ValueError, match="verification block"):
        Scheduler(BlockManager(8, 4), max_num_batched_tokens=K, max_draft_tokens=K, max_model_len=64,
                  eos_token_ids=frozenset())


def test_copy_on_write_is_recorded_only_for_a_scheduled_item():
    """A verification whose block must be copied (it is shared) and whose table must grow, with a pool that
    has room for the copy but not for both: the step is empty, and it must carry no copy, nor leave the
    sequence's table pointing at a copy nobody made."""
    blocks = BlockManager(3, 4)
    scheduler = Scheduler(blocks, max_num_batched_tokens=16, max_draft_tokens=K, max_model_len=64,
                          eos_token_ids=frozenset())
    key = SeqKey(1, 1)
    seq = Sequence(key, [3, 4, 5, 6, 7, 8], 6, SamplingParams(temperature=0.0).with_seed())
    scheduler.add(seq)
    prefill = scheduler.schedule()  # admitted; its first 5 tokens fill 2 blocks
    assert [(s.start, s.end) for s in prefill.scheduled] == [(0, 5)]
    scheduler.postprocess(prefill, [], 0.0)
    blocks.fork(key, "holder")  # another table holds both blocks: writing position 5 needs a copy of block 1
    table, free = list(blocks.table(key)), blocks.num_free_blocks
    assert free == 1
    seq.proposals.append(ProposeCmd(key, 6, (7, 7, 7, 7), None))  # [5, 10): the copy and a third block
    out = scheduler.schedule()
    assert out.scheduled == [] and out.block_copies == []
    assert blocks.table(key) == table and blocks.num_free_blocks == free


def test_a_step_in_flight_when_its_stream_closes_does_not_bring_back_its_metric_series(pair):
    """The stream closes (its series are removed) while a step that scheduled its sequence runs; recording
    that step afterwards must not create the stream's series again."""
    target, _ = pair
    engine = _engine(target, num_blocks=32)
    metrics = VerifierMetrics()
    entered, go, later = threading.Event(), threading.Event(), threading.Event()
    real_step, calls = engine.step, []

    def step(max_verifications=None, awaited=None, held_s=0.0):  # the first step holds its result until the stream has closed
        calls.append(1)
        if len(calls) > 1:
            later.set()
            return real_step(max_verifications, awaited, held_s)
        result = real_step(max_verifications, awaited, held_s)
        entered.set()
        go.wait(30)
        return result

    engine.step = step
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True).with_seed()

    async def scenario() -> int:
        async_engine = AsyncEngine(engine, metrics)
        async_engine.start()
        stream_id, _ = async_engine.open_stream()
        async_engine.submit(OpenCmd(SeqKey(stream_id, 1), (3, 4, 5, 6), greedy))
        async_engine.submit(ProposeCmd(SeqKey(stream_id, 1), 4, (7, 7), None))
        assert await asyncio.to_thread(entered.wait, 30)
        async_engine.close_stream(stream_id)  # while the step that runs its sequence is in flight
        go.set()
        assert await asyncio.to_thread(later.wait, 30)  # the next step starts once the first one is recorded
        await async_engine.stop()
        return stream_id

    stream_id = asyncio.run(scenario())
    registry = metrics.registry
    assert registry.get_sample_value("specwire_steps_total") >= 1  # the in-flight step was recorded
    labels = {"stream": str(stream_id)}
    assert registry.get_sample_value("specwire_stream_scheduled_tokens_total", labels) is None
    assert registry.get_sample_value("specwire_stream_sequences", labels) is None
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.sequences
