"""The verifier engine in-process: prefix sharing, preemption by recompute, queueing when the pool is short,
refusal of what can never fit, and no leaked blocks."""

from __future__ import annotations

import pytest

from common.errors import ErrorCode
from common.sampling import FinishReason, SamplingParams, SparseProbs, WireMode
from verifier_service.config import VerifierConfig
from verifier_service.server import build_engine
from verifier_service.types import CloseCmd, CloseStreamCmd, ErrorOut, OpenCmd, ProposeCmd, SeqKey, VerdictOut

from tiny_models import greedy_continuation, make_text_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("engine"), "qwen2")


def _engine(target, **kwargs):
    config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=4, **kwargs)
    return build_engine(config)


def _run(engine, prompts, n, *, k=4, oracle=None, max_steps=2000):
    """Greedy generation of n tokens per prompt, proposing k drafts per round (from `oracle` if given, else
    a fixed wrong guess). Returns the outputs and every step's stats."""
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    keys = [SeqKey(1, i) for i in range(len(prompts))]
    out = {key: [] for key in keys}
    pending = set()
    for key, prompt in zip(keys, prompts, strict=True):
        engine.submit(OpenCmd(key, tuple(prompt), greedy.with_seed()))
    done, all_stats = set(), []
    for _ in range(max_steps):
        for i, key in enumerate(keys):
            if key not in done and key not in pending:
                pos = len(prompts[i]) + len(out[key])
                drafts = oracle[i][len(out[key]):len(out[key]) + k] if oracle else [7] * k
                engine.submit(ProposeCmd(key, pos, tuple(drafts), None))
                pending.add(key)
        result = engine.step()
        if result.stats:
            all_stats.append(result.stats)
        for o in result.outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, VerdictOut):
                pending.discard(o.key)
                out[o.key].extend(o.token_ids)
                if o.finish_reason:
                    done.add(o.key)
        if len(done) == len(keys):
            return [out[k] for k in keys], all_stats
    raise AssertionError("generation did not finish")


def test_shared_system_prompt_is_computed_once(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    system = list(range(3, 43))  # 40 tokens = 10 blocks of 4
    (first,), stats1 = _run(engine, [system + [50, 51]], 4)
    (second,), stats2 = _run(engine, [system + [60, 61, 62]], 4)
    computed1 = sum(s.num_prefill_tokens for s in stats1)
    computed2 = sum(s.num_prefill_tokens for s in stats2)
    hits2 = sum(s.num_prefix_hit_tokens for s in stats2)
    assert computed1 == len(system) + 1  # every prompt token but the last, which the first verify block feeds
    assert hits2 == 40 and computed2 == 2  # only the new tokens (but the last) are computed
    assert second == greedy_continuation(target, system + [60, 61, 62], 4)
    assert first == greedy_continuation(target, system + [50, 51], 4)
    assert engine.blocks.num_used_blocks == 0


def test_preemption_by_recompute_keeps_outputs_exact(pair):
    target, _ = pair
    prompts = [[5 + i, 9, 11 + i, 4, 8] for i in range(6)]
    oracle = [greedy_continuation(target, p, 24) for p in prompts]
    # 6 sequences of up to 5 + 24 + 4 tokens need 48 blocks of 4; the pool has 20
    engine = _engine(target, num_blocks=20)
    outputs, stats = _run(engine, prompts, 24, oracle=oracle)
    assert outputs == oracle
    assert engine.scheduler.num_preemptions > 0 and sum(s.num_preempted for s in stats) == engine.scheduler.num_preemptions
    assert engine.blocks.num_used_blocks == 0


def test_new_sequences_wait_for_blocks_instead_of_failing(pair):
    target, _ = pair
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11] for _ in range(5)]
    engine = _engine(target, num_blocks=8)  # room for about two sequences at a time
    outputs, stats = _run(engine, prompts, 8)
    expected = greedy_continuation(target, prompts[0], 8)
    assert all(o == expected for o in outputs)
    assert max(s.num_seqs for s in stats) < 5
    assert engine.blocks.num_used_blocks == 0


def test_a_sequence_that_can_never_fit_is_resource_exhausted(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=4)  # 16 tokens
    key = SeqKey(1, 1)
    engine.submit(OpenCmd(key, tuple(range(3, 20)), SamplingParams(temperature=0.0).with_seed()))
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert errors and errors[0].code is ErrorCode.RESOURCE_EXHAUSTED and "KV blocks" in errors[0].message
    assert engine.blocks.num_used_blocks == 0


def test_closing_a_stream_frees_its_sequences(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=32)
    for i in range(3):
        engine.submit(OpenCmd(SeqKey(9, i), (3, 4, 5, 6, 7, 8), SamplingParams(temperature=0.0).with_seed()))
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.submit(CloseStreamCmd(9))
    engine.step()
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.sequences


def test_a_failing_step_ends_exactly_its_sequences_and_the_engine_goes_on(pair, monkeypatch):
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True).with_seed()
    a, b = SeqKey(1, 1), SeqKey(1, 2)
    for key in (a, b):
        engine.submit(OpenCmd(key, (3, 4, 5, 6), greedy))
        engine.submit(ProposeCmd(key, 4, (7, 7), None))
    real_run = engine.runner.run

    def broken(out):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "run", broken)
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert sorted(e.key.seq_id for e in errors) == [1, 2]
    assert all(e.code is ErrorCode.INTERNAL and "injected device fault" in e.message for e in errors)
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.sequences
    monkeypatch.setattr(engine.runner, "run", real_run)
    (out,), _ = _run(engine, [[3, 4, 5, 6]], 4, oracle=[greedy_continuation(target, [3, 4, 5, 6], 4)])
    assert out == greedy_continuation(target, [3, 4, 5, 6], 4)
    assert engine.blocks.num_used_blocks == 0


def test_a_sequence_idle_past_the_timeout_is_ended_and_its_blocks_freed(pair):
    import time

    target, _ = pair
    engine = _engine(target, num_blocks=32, sequence_idle_timeout_s=0.2)
    quiet, busy = SeqKey(1, 1), SeqKey(1, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True).with_seed()
    engine.submit(OpenCmd(quiet, (3, 4, 5, 6, 7, 8), greedy))
    engine.step()  # admitted and prefilled: it holds blocks
    assert engine.blocks.num_used_blocks > 0 and engine.next_expiry() is not None
    time.sleep(0.3)
    engine.submit(OpenCmd(busy, (3, 4, 5), greedy))
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert [(e.key, e.code) for e in errors] == [(quiet, ErrorCode.DEADLINE_EXCEEDED)]
    assert "idle" in errors[0].message or "no proposal" in errors[0].message
    assert quiet not in engine.scheduler.sequences and busy in engine.scheduler.sequences


def test_a_draft_that_floods_proposals_gets_resource_exhausted(pair):
    from verifier_service.admission import MAX_QUEUED_PROPOSALS

    target, _ = pair
    engine = _engine(target, num_blocks=32)
    key = SeqKey(4, 1)
    engine.submit(OpenCmd(key, (3, 4, 5), SamplingParams(temperature=0.0).with_seed()))
    for i in range(MAX_QUEUED_PROPOSALS + 1):
        engine.submit(ProposeCmd(key, 3 + i, (7,), None))
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert [e.code for e in errors] == [ErrorCode.RESOURCE_EXHAUSTED] and "proposals waiting" in errors[0].message
    assert key not in engine.scheduler.sequences and engine.blocks.num_used_blocks == 0


def test_a_sequence_admitted_between_two_steps_of_another_reuses_only_verified_kv(pair):
    """A's verification writes rejected drafts' K/V into slots past its verified tokens; B, opened right after
    with A's tokens as its prompt prefix, may reuse only blocks whose every slot holds verified K/V."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    a = SeqKey(2, 0)
    a_prompt = [3, 4, 5, 6, 7, 8, 9]
    first = greedy_continuation(target, a_prompt, 1)[0]
    wrong = (first + 1) % 300
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True).with_seed()
    engine.submit(OpenCmd(a, tuple(a_prompt), greedy))
    engine.submit(ProposeCmd(a, len(a_prompt), (wrong,) * 4, None))
    verdict = next(o for o in engine.step().outcomes if isinstance(o, VerdictOut))
    assert verdict.num_accepted == 0 and list(verdict.token_ids) == [first]
    b_prompt = a_prompt + [first, 11]
    (b_out,), _ = _run(engine, [b_prompt], 4)
    assert b_out == greedy_continuation(target, b_prompt, 4)


def test_a_sequence_past_its_client_deadline_is_ended_and_its_blocks_freed(pair):
    import time

    target, _ = pair
    engine = _engine(target, num_blocks=32)
    late, patient = SeqKey(1, 1), SeqKey(1, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True).with_seed()
    engine.submit(OpenCmd(late, (3, 4, 5, 6, 7, 8), greedy, deadline=time.monotonic() + 0.2))
    engine.submit(OpenCmd(patient, (3, 4, 5), greedy, deadline=time.monotonic() + 60))
    engine.step()
    assert engine.blocks.num_used_blocks > 0 and engine.next_expiry() is not None
    time.sleep(0.3)
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert [(e.key, e.code) for e in errors] == [(late, ErrorCode.DEADLINE_EXCEEDED)]
    assert "deadline" in errors[0].message
    assert late not in engine.scheduler.sequences and patient in engine.scheduler.sequences


def _rounds(engine, key, prompt, sampling, n_rounds, *, num_output_tokens=0):
    """Open `key` and run n_rounds rounds of 3 fixed (mostly wrong) drafts: the verified tokens of each round."""
    engine.submit(OpenCmd(key, tuple(prompt), sampling, num_output_tokens=num_output_tokens))
    tokens, rounds = list(prompt), []
    for _ in range(n_rounds):
        engine.submit(ProposeCmd(key, len(tokens), (7, 8, 9), None))
        verdict = None
        while verdict is None:
            verdict = next((o for o in engine.step().outcomes if o.key == key), None)
        assert isinstance(verdict, VerdictOut), verdict
        rounds.append(list(verdict.token_ids))
        tokens.extend(verdict.token_ids)
        if verdict.finish_reason:
            break
    return rounds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_sequence_continues_exactly_where_it_was(pair, temperature):
    """A resume sends the verified tokens so far as the prompt with num_output_tokens: the continuation (seeded
    random numbers are keyed by position) and the max_tokens count are those of the uninterrupted sequence."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    sampling = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=1234)
    prompt = [3, 4, 5, 6, 7]
    whole = _rounds(engine, SeqKey(1, 1), prompt, sampling, 100)
    assert sum(map(len, whole)) == 12
    cut = 2  # the stream broke after two rounds
    so_far = [t for r in whole[:cut] for t in r]
    resumed = _rounds(engine, SeqKey(2, 1), prompt + so_far, sampling, 100, num_output_tokens=len(so_far))
    assert resumed == whole[cut:]
    assert engine.blocks.num_used_blocks == 0


def test_a_resume_that_claims_too_much_output_is_refused(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=32)
    sampling = SamplingParams(temperature=0.0, max_tokens=4).with_seed()
    engine.submit(OpenCmd(SeqKey(1, 1), (3, 4, 5), sampling, num_output_tokens=3))
    engine.submit(OpenCmd(SeqKey(1, 2), (3, 4, 5, 6, 7, 8), sampling, num_output_tokens=4))
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert [e.code for e in errors] == [ErrorCode.INVALID_ARGUMENT] * 2
    assert "at least one prompt token" in errors[0].message and "finished" in errors[1].message


def test_the_token_budget_is_shared_fairly_between_streams(pair):
    """One stream runs 16 sequences, another 1; the budget holds three verifications a step. Admitted after
    the 16, the single sequence still gets a verification in every step while it has a proposal waiting."""
    target, _ = pair
    engine = _engine(target, num_blocks=256, max_num_batched_tokens=15)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    many = [SeqKey(1, i) for i in range(16)]
    single = SeqKey(2, 0)
    tokens = {key: [3, 4, 5] for key in [*many, single]}
    for key in [*many, single]:
        engine.submit(OpenCmd(key, tuple(tokens[key]), greedy))
    served = {key: 0 for key in tokens}
    waiting = set()
    for _ in range(24):
        for key in tokens:
            if key not in waiting:
                engine.submit(ProposeCmd(key, len(tokens[key]), (7, 8, 9, 10), None))
                waiting.add(key)
        result = engine.step()
        verdicts = [o for o in result.outcomes if isinstance(o, VerdictOut)]
        assert result.stats.num_tokens <= 15 and verdicts
        assert single in {v.key for v in verdicts}
        for v in verdicts:
            tokens[v.key].extend(v.token_ids)
            served[v.key] += 1
            waiting.discard(v.key)
    assert served[single] == 24
    assert min(served[k] for k in many) >= 1  # and the 16 take turns among themselves


@pytest.mark.parametrize("assumed", ["right", "wrong guess", "wrong earlier token"])
def test_a_pipelined_proposal_is_verified_only_after_the_tokens_it_assumed(pair, assumed):
    """Block A is fully accepted; block B, sent before A's verdict, starts where A's verdict ends. It is
    verified when A's tokens and the bonus token are those it was drafted after, and dropped otherwise, even
    though its position matches."""
    from verifier_service.types import DroppedOut

    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [3, 4, 5, 6]
    truth = greedy_continuation(target, prompt, 9)
    key = SeqKey(1, 1)
    engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=20).with_seed()))
    engine.submit(ProposeCmd(key, 4, tuple(truth[:3]), None))
    tokens = list(truth[:4])
    if assumed == "wrong guess":
        tokens[3] = (tokens[3] + 1) % 300
    elif assumed == "wrong earlier token":  # the last token right, an earlier one not: still another prefix
        tokens[1] = (tokens[1] + 1) % 300
    engine.submit(ProposeCmd(key, 8, tuple(truth[4:7]), None, assumed_token_ids=tuple(tokens)))
    outcomes = engine.step().outcomes + engine.step().outcomes
    verdicts = [o for o in outcomes if isinstance(o, VerdictOut)]
    dropped = [o for o in outcomes if isinstance(o, DroppedOut)]
    assert list(verdicts[0].token_ids) == truth[:4]
    if assumed == "right":
        assert not dropped and list(verdicts[1].token_ids) == truth[4:8]
    else:
        assert len(verdicts) == 1 and [(d.start_position, d.num_verified) for d in dropped] == [(8, 8)]


def test_of_a_drafts_pipelined_branches_only_the_one_the_verdict_confirms_is_verified(pair):
    """Block B's first draft is right, its second wrong. Branches for every verdict B could get were sent
    before it: the one that assumed one accepted draft and the right correction is verified; the others are
    dropped, including those that can never match, at once, so the queue never fills."""
    from verifier_service.types import DroppedOut

    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [3, 4, 5, 6]
    truth = greedy_continuation(target, prompt, 8)
    wrong = [(t + 1) % 300 for t in truth]
    key = SeqKey(1, 1)
    engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=20).with_seed()))
    block = (truth[0], wrong[1], wrong[2])
    engine.submit(ProposeCmd(key, 4, block, None))
    branches = {0: (wrong[0],), 1: (truth[0], truth[1]), 2: (truth[0], wrong[1], wrong[2]),
                3: (*block, wrong[3])}
    for j, assumed in branches.items():  # branch j assumed j accepted drafts, then its guess
        engine.submit(ProposeCmd(key, 4 + j + 1, (7, 7), None, assumed_token_ids=assumed))
    outcomes = engine.step().outcomes + engine.step().outcomes + engine.step().outcomes
    verdicts = [o for o in outcomes if isinstance(o, VerdictOut)]
    dropped = sorted(o.start_position for o in outcomes if isinstance(o, DroppedOut))
    assert [(v.start_position, list(v.token_ids)) for v in verdicts] == [(4, truth[:2]), (6, [truth[2]])]
    assert dropped == [5, 7, 8]
    assert not engine.scheduler.sequences[key].proposals


def test_a_stream_may_hold_only_so_many_open_sequences(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=32, max_sequences_per_stream=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=5).with_seed()
    for i in range(4):
        engine.submit(OpenCmd(SeqKey(1, i), (3, 4, 5), greedy))
    engine.submit(OpenCmd(SeqKey(2, 0), (3, 4, 5), greedy))  # another stream has its own allowance
    errors = [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]
    assert [(e.key, e.code) for e in errors] == [(SeqKey(1, 3), ErrorCode.RESOURCE_EXHAUSTED)]
    assert "--max-sequences-per-stream" in errors[0].message
    engine.submit(CloseCmd(SeqKey(1, 0)))
    engine.submit(OpenCmd(SeqKey(1, 4), (3, 4, 5), greedy))  # room again once one is closed
    assert not [o for o in engine.step().outcomes if isinstance(o, ErrorOut)]


# -- --max-waiting-tokens counts what still waits once admission was tried ---------------------------------------

def _errors(result) -> list[ErrorOut]:
    return [o for o in result.outcomes if isinstance(o, ErrorOut)]


def _prompt(i: int, n: int) -> tuple[int, ...]:
    """Prompt i: n tokens shared with no other prompt here, so the prefix cache admits none early."""
    return tuple(range(30 + 20 * i, 30 + 20 * i + n))


def _fill_most_of_the_pool(engine) -> None:
    """One running sequence of 20 tokens: its prefill holds 5 of 8 blocks, so a 10-token prompt (4 blocks with
    a draft block) waits."""
    sampling = SamplingParams(temperature=0.0, max_tokens=50).with_seed()
    engine.submit(OpenCmd(SeqKey(1, 0), tuple(range(3, 23)), sampling))
    assert not _errors(engine.step())
    assert engine.blocks.num_free_blocks == 3


def test_a_burst_of_opens_the_pool_takes_at_once_is_not_refused_by_max_waiting_tokens(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=64, max_waiting_tokens=20)
    greedy = SamplingParams(temperature=0.0, max_tokens=5).with_seed()
    for i in range(4):  # 40 tokens in one batch of commands, each admitted as it opens
        engine.submit(OpenCmd(SeqKey(1, i), _prompt(i, 10), greedy))
    assert not _errors(engine.step())
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting


def test_a_burst_of_resumes_is_never_refused_by_max_waiting_tokens(pair):
    """After a verifier restart the drafts reopen what they had: those sequences fitted before, so they wait
    for blocks rather than be refused. They do count as waiting: a new prompt behind them is refused."""
    target, _ = pair
    engine = _engine(target, num_blocks=8, max_waiting_tokens=20)
    _fill_most_of_the_pool(engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=50).with_seed()
    for i in range(1, 6):  # 50 tokens waiting, each with 2 tokens of earlier output
        engine.submit(OpenCmd(SeqKey(1, i), _prompt(i, 10), sampling, num_output_tokens=2))
    engine.submit(OpenCmd(SeqKey(1, 9), _prompt(9, 10), sampling))
    errors = _errors(engine.step())
    assert [(e.key, e.code) for e in errors] == [(SeqKey(1, 9), ErrorCode.RESOURCE_EXHAUSTED)]
    assert "--max-waiting-tokens" in errors[0].message
    assert len(engine.scheduler.waiting) == 5 and engine.scheduler.num_waiting_tokens == 50


def test_opens_that_would_wait_past_max_waiting_tokens_are_refused(pair):
    target, _ = pair
    engine = _engine(target, num_blocks=8, max_waiting_tokens=20)
    _fill_most_of_the_pool(engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=50).with_seed()
    engine.submit(OpenCmd(SeqKey(1, 1), _prompt(1, 12), sampling))  # waits: 12 tokens
    engine.submit(OpenCmd(SeqKey(1, 2), _prompt(2, 10), sampling))  # 22 > 20
    engine.submit(OpenCmd(SeqKey(1, 3), _prompt(3, 8), sampling))  # 20: within
    errors = _errors(engine.step())
    assert [(e.key, e.code) for e in errors] == [(SeqKey(1, 2), ErrorCode.RESOURCE_EXHAUSTED)]
    assert "--max-waiting-tokens" in errors[0].message and "22" in errors[0].message
    assert engine.scheduler.num_waiting_tokens == sum(s.num_tokens for s in engine.scheduler.waiting) == 20
    engine.submit(CloseCmd(SeqKey(1, 0)))  # blocks free: both are admitted, nothing counts as waiting
    assert not _errors(engine.step())
    assert not engine.scheduler.waiting and engine.scheduler.num_waiting_tokens == 0
    engine.submit(CloseStreamCmd(1))
    engine.step()
    assert engine.blocks.num_used_blocks == 0


def test_an_open_past_a_limit_is_refused_before_its_prompt_is_checked(pair, monkeypatch):
    """The O(1) limits come first: an open past one costs nothing to refuse however long its prompt is (its
    out-of-vocabulary token is never looked at)."""
    from verifier_service import validation

    target, _ = pair
    engine = _engine(target, num_blocks=8, max_sequences_per_stream=1, max_waiting_tokens=20)
    _fill_most_of_the_pool(engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=50).with_seed()
    checked = []
    monkeypatch.setattr(validation, "validate_token_ids", lambda ids, *a, **kw: checked.append(len(ids)))
    engine.submit(OpenCmd(SeqKey(1, 1), (3, 10_000, 5), sampling))  # past --max-sequences-per-stream
    other = _engine(target, num_blocks=8, max_waiting_tokens=20)
    _fill_most_of_the_pool(other)
    other.submit(OpenCmd(SeqKey(1, 1), _prompt(1, 12), sampling))  # waits: 12 tokens
    checked.clear()
    other.submit(OpenCmd(SeqKey(1, 2), (3, 10_000) * 5, sampling))  # would wait past --max-waiting-tokens
    errors = _errors(engine.step()) + _errors(other.step())
    assert [e.code for e in errors] == [ErrorCode.RESOURCE_EXHAUSTED] * 2
    assert "--max-sequences-per-stream" in errors[0].message and "--max-waiting-tokens" in errors[1].message
    assert checked == [12]  # only the one that was opened


def test_each_verdict_names_its_step_and_how_many_of_its_stream_go_on(pair):
    """Verdict.step and step_verdicts (draft_service.due_rounds): per step, a number that grows, and per stream the
    count of that step's verdicts whose sequences go on; a verdict that ends its sequence counts for none."""
    target, _ = pair
    engine = _engine(target, num_blocks=256)
    keys = [SeqKey(1, 0), SeqKey(1, 1), SeqKey(1, 2), SeqKey(2, 0)]
    lengths = {SeqKey(1, 0): 1, SeqKey(1, 1): 40, SeqKey(1, 2): 40, SeqKey(2, 0): 40}  # (1, 0) ends in a round
    for key in keys:
        params = SamplingParams(temperature=0.0, max_tokens=lengths[key], ignore_eos=True).with_seed()
        engine.submit(OpenCmd(key, (3, 4, 5), params))
    position = dict.fromkeys(keys, 3)
    seen = []
    for _ in range(2):
        for key in keys:
            if key in position:
                engine.submit(ProposeCmd(key, position[key], (7, 8), None))
        verdicts = [o for o in engine.step().outcomes if isinstance(o, VerdictOut)]
        assert {v.key for v in verdicts} == set(position)
        for v in verdicts:
            position[v.key] += len(v.token_ids)
            if v.finish_reason is not None:
                assert (v.step, v.step_verdicts) == (0, 0)
                del position[v.key]
        seen.append({v.key: (v.step, v.step_verdicts) for v in verdicts if v.finish_reason is None})
    first, second = seen
    step = first[SeqKey(1, 1)][0]
    assert first == {SeqKey(1, 1): (step, 2), SeqKey(1, 2): (step, 2), SeqKey(2, 0): (step, 1)}
    assert second == {SeqKey(1, 1): (step + 1, 2), SeqKey(1, 2): (step + 1, 2), SeqKey(2, 0): (step + 1, 1)}


def test_a_request_that_ends_in_its_first_step_leaves_its_prompt_in_the_prefix_cache(pair):
    """One output token: prefill, verification and finish in one step, which registered nothing before."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks of 4 before the last
    (first,), stats1 = _run(engine, [prompt], 1)
    assert len(stats1) == 1 and first == greedy_continuation(target, prompt, 1)
    (again,), stats2 = _run(engine, [prompt], 3)
    assert sum(s.num_prefix_hit_tokens for s in stats2) == 16
    assert again == greedy_continuation(target, prompt, 3)
    assert engine.blocks.num_used_blocks == 0


def test_a_request_that_ends_on_accepted_drafts_leaves_them_in_the_prefix_cache(pair):
    """The last step accepts 4 drafts and ends the request: their K/V (written, verified) is registered, and a
    prompt that continues the output reuses it; the finishing bonus token, which has no K/V, is not."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [5, 9, 11, 4, 8, 6]
    oracle = greedy_continuation(target, prompt, 10)
    (out,), stats = _run(engine, [prompt], 10, oracle=[oracle])
    assert out == oracle and len(stats) == 2  # 4 drafts and a bonus a step
    # 6 + 10 tokens, K/V for the first 15: three full blocks; before, only the first step's two were registered
    follow = prompt + out + [21]
    (more,), stats2 = _run(engine, [follow], 2)
    assert sum(s.num_prefix_hit_tokens for s in stats2) == 12
    assert more == greedy_continuation(target, follow, 2)
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("params, verified, resumed", [
    (SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 2, 2),  # 2 of 5 emitted before a resume

    (SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 2, 0),  # greedy: at most 3 tokens, 2 drafts
    (SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, wire_mode=WireMode.COUPLED), 2, 0),
    (SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), 0, 0),
    (SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), 4, 0),  # room for all of them
    # rejection sampling decides a drafted position and a bonus one differently: a seeded request's tokens would
    # change with where its last round is cut, so its drafts are verified as sent
    (SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, wire_mode=WireMode.SPARSE), 4, 0),
])
def test_drafts_past_what_a_sequence_may_still_emit_are_not_verified(pair, params, verified, resumed):
    """A block of k yields up to k + 1 tokens: a proposal longer than the request's room (a fixed k's last round,
    a pipelined branch drafted before its room was known) is verified only as far as it may emit."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [5, 9, 11, 4, 8, 6]
    prompt += greedy_continuation(target, prompt, resumed)  # a resume: its earlier output ends the prompt
    key = SeqKey(1, 0)
    engine.submit(OpenCmd(key, tuple(prompt), params.with_seed(), num_output_tokens=resumed))
    drafts = tuple(greedy_continuation(target, prompt, 4))  # the target's own: all accepted when verified
    engine.submit(ProposeCmd(key, len(prompt), drafts, None))
    result = engine.step()
    (verdict,) = [o for o in result.outcomes if isinstance(o, VerdictOut)]
    assert result.stats.num_draft_tokens == verified
    assert result.stats.num_tokens == len(prompt) + verified
    left = params.max_tokens - resumed
    assert len(verdict.token_ids) <= min(left, verified + 1)
    if params.is_greedy:  # every draft accepted: the room's tokens, the target's own
        assert list(verdict.token_ids) == greedy_continuation(target, prompt, min(left, 5))
        assert (verdict.finish_reason is not None) == (left <= 5)
    engine.submit(CloseCmd(key))
    engine.step()
    assert engine.blocks.num_used_blocks == 0


def test_a_proposal_within_positions_keeps_the_shallow_nodes_that_come_first():
    key = SeqKey(1, 1)
    chain = ProposeCmd(key, 5, (4, 5, 6, 7), None)
    assert chain.within_positions(2).draft_token_ids == (4, 5)
    assert chain.within_positions(0).num_draft_tokens == 0
    assert chain.within_positions(4) is chain and chain.within_positions(9) is chain
    tree = ProposeCmd(key, 5, (4, 5, 6, 7, 8, 9), None, draft_parents=(-1, -1, 0, 0, 1, 3))  # depths 0 0 1 1 1 2
    assert tree.within_positions(2).draft_parents == (-1, -1, 0, 0, 1)
    assert tree.within_positions(1).draft_token_ids == (4, 5) and tree.within_positions(1).draft_parents == (-1, -1)
    late = ProposeCmd(key, 5, (4, 5, 6, 7), None, draft_parents=(-1, 0, -1, 2))  # depths 0 1 0 1: not by depth
    cut = late.within_positions(1)
    assert cut.draft_token_ids == (4, 6) and cut.draft_parents == (-1, -1)
    sparse = ProposeCmd(key, 5, (4, 5, 6), tuple(SparseProbs((t,), (1.0,)) for t in (4, 5, 6)), draft_parents=(-1, 0, -1))
    assert [q.token_ids for q in sparse.within_positions(1).draft_probs] == [(4,), (6,)]
    assert late.within_positions(0).num_draft_tokens == 0


def _opening(engine, key, prompt, sampling, guess, drafts, *, ahead_first=True):
    """An opening as a draft under --speculation auto sends it: the prompt with an empty block, then the block
    drafted ahead after a guess of the first token. `ahead_first`: both are in before the prompt's step (folded);
    else the block ahead arrives after that step, as when the verifier was idle. The verified tokens, the
    verdicts and outcomes of every step, and their stats."""
    from verifier_service.types import DroppedOut

    engine.submit(OpenCmd(key, tuple(prompt), sampling))
    engine.submit(ProposeCmd(key, len(prompt), (), None, max_draft_tokens=4))
    ahead = ProposeCmd(key, len(prompt) + 1, tuple(drafts), None, assumed_token_ids=(guess,), max_draft_tokens=4)
    if ahead_first:
        engine.submit(ahead)
    verdicts, dropped, stats = [], [], []
    tokens = list(prompt)
    while not verdicts or not verdicts[-1].finish_reason:
        result = engine.step()
        if not ahead_first:
            engine.submit(ahead)
            ahead_first = True
        stats.append(result.stats)
        for o in result.outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, DroppedOut):
                dropped.append(o.start_position)
            elif isinstance(o, VerdictOut):
                assert o.start_position == len(tokens)
                verdicts.append(o)
                tokens.extend(o.token_ids)
        seq = engine.scheduler.sequences.get(key)
        if verdicts and seq is not None and not seq.proposals:  # the next round's block
            engine.submit(ProposeCmd(key, len(tokens), (7, 7), None, max_draft_tokens=4))
    return tokens[len(prompt):], verdicts, dropped, [s for s in stats if s is not None]


@pytest.mark.parametrize("guess", ["right", "wrong"])
def test_an_opening_s_block_drafted_ahead_rides_on_the_prompt_s_step(pair, guess):
    """Greedy: an empty opening block and the block drafted ahead after a guess of the first token, both in
    before the prompt's step, are verified in that step as one block (the guess its first draft, at most
    max_draft_tokens in all) and answered as the two verdicts the draft awaits: the first token alone (no step
    number: the draft drafts nothing after it), then the block's. A wrong guess is a rejected first draft: the
    first token alone, and the block ahead dropped as stale. The output is the target's own either way."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [5, 9, 11, 4, 8, 6]
    truth = greedy_continuation(target, prompt, 12)
    g = truth[0] if guess == "right" else (truth[0] + 1) % 300
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True).with_seed()
    out, verdicts, dropped, stats = _opening(engine, SeqKey(1, 0), prompt, sampling, g, truth[1:5])
    assert out == truth
    first = stats[0]
    assert first.num_prefill_tokens == len(prompt) - 1 and first.num_verifications == 1
    assert first.num_draft_tokens == 4  # the guess and 3 of the block's 4: a block holds max_draft_tokens
    assert (first.num_folded, first.num_folds_held) == (1, int(guess == "right"))
    n = len(prompt)
    if guess == "right":
        assert [(v.start_position, v.num_accepted, list(v.token_ids)) for v in verdicts[:2]] == [
            (n, 0, truth[:1]), (n + 1, 3, truth[1:5])]
        assert (verdicts[0].step, verdicts[0].step_verdicts) == (0, 0)  # the draft drafts after the second alone
        assert verdicts[1].step > 0 and verdicts[1].step_verdicts == 1
        assert verdicts[0].next_draft_tokens == verdicts[1].next_draft_tokens is not None  # the choice, on both
        assert not dropped
    else:
        assert [(v.start_position, v.num_accepted, list(v.token_ids)) for v in verdicts[:1]] == [(n, 0, truth[:1])]
        assert verdicts[0].step > 0 and dropped == [n + 1]
        assert stats[1].num_verifications == 1 and stats[1].num_draft_tokens == 2  # the next round's own block
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("end", ["eos at the guess", "length in the block"])
def test_a_fold_that_ends_the_sequence_answers_as_the_unfolded_round_would(pair, end):
    """A guess that held on a token that ends the sequence (EOS): the empty block's verdict alone, finished,
    accepting nothing (the guess is no draft of its). A request whose last token is in the folded block: the
    first token's verdict, then the block's, finished at max_tokens."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    prompt = [5, 9, 11, 4, 8, 6]
    truth = greedy_continuation(target, prompt, 6)
    n = len(prompt)
    if end == "eos at the guess":
        engine.scheduler.eos_token_ids = frozenset({truth[0]})
        sampling = SamplingParams(temperature=0.0, max_tokens=6).with_seed()
    else:
        sampling = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True).with_seed()
    out, verdicts, dropped, stats = _opening(engine, SeqKey(1, 0), prompt, sampling, truth[0], truth[1:5])
    assert stats[0].num_folded == stats[0].num_folds_held == 1 and not dropped
    summary = [(v.start_position, v.num_accepted, list(v.token_ids), v.finish_reason) for v in verdicts]
    if end == "eos at the guess":
        assert summary == [(n, 0, truth[:1], FinishReason.STOP)]
    else:
        assert stats[0].num_draft_tokens == 2  # the guess and one draft: three tokens in all
        assert summary == [(n, 0, truth[:1], None), (n + 1, 1, truth[1:3], FinishReason.LENGTH)]
    assert engine.blocks.num_used_blocks == 0


def test_a_fold_takes_free_blocks_only_and_never_preempts_for_them(pair, monkeypatch):
    """The fold is optional: where the pool has no free blocks for its drafts, the empty block is verified alone
    and no other sequence is preempted for it."""
    target, _ = pair
    engine = _engine(target, num_blocks=64)
    other, key = SeqKey(2, 0), SeqKey(1, 0)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True).with_seed()
    engine.submit(OpenCmd(other, (3, 4, 5, 6, 7, 8, 9, 10), sampling))
    engine.step()  # its prompt is computed; it holds blocks, with no work in the next step
    prompt = [5, 9, 11, 4, 8, 6]
    truth = greedy_continuation(target, prompt, 6)
    reserve = engine.blocks.reserve
    monkeypatch.setattr(engine.blocks, "reserve", lambda k, start, end: None if k == key and end > len(prompt)
                        else reserve(k, start, end))
    engine.submit(OpenCmd(key, tuple(prompt), sampling))
    engine.submit(ProposeCmd(key, len(prompt), (), None, max_draft_tokens=4))
    engine.submit(ProposeCmd(key, len(prompt) + 1, tuple(truth[1:4]), None, assumed_token_ids=tuple(truth[:1]),
                             max_draft_tokens=4))
    result = engine.step()
    assert engine.scheduler.num_preemptions == 0 and other in engine.scheduler.running
    assert result.stats.num_draft_tokens == 0 and result.stats.num_folded == 0
    assert [list(o.token_ids) for o in result.outcomes if isinstance(o, VerdictOut)] == [truth[:1]]


@pytest.mark.parametrize("case", ["coupled", "sparse", "one-hot", "late", "tree", "two assumed", "one token",
                                  "drafted head", "q", "misplaced"])
def test_an_opening_folds_only_where_no_draft_changes_the_output(pair, case):
    """Coupled sampling folds, and its output is the unfolded one token for token (each token is the target's,
    keyed by seed and position). A sampled request (sparse: q sent; one-hot: none; rejection sampling decides a
    drafted and a bonus position differently), a block ahead that arrives after the prompt's step started, a tree, a block that
    assumed more than the first token, a request of one token (nothing drafted may be verified), a head that
    drafted itself, a block with q, and one that does not start right after the head are each verified on their
    own."""
    target, _ = pair
    prompt = [5, 9, 11, 4, 8, 6]
    params = {"coupled": SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=77,
                                        wire_mode=WireMode.COUPLED),
              "sparse": SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=77,
                                       wire_mode=WireMode.SPARSE),
              "one-hot": SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=77,
                                        wire_mode=WireMode.ONE_HOT),
              "one token": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)}
    sampling = params.get(case, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)).with_seed()
    truth, *_ = _opening(_engine(target, num_blocks=64), SeqKey(1, 0), prompt, sampling, 0, (), ahead_first=False)
    engine = _engine(target, num_blocks=64)
    key = SeqKey(1, 0)
    drafts = tuple(truth[1:4])
    if case in ("tree", "two assumed", "sparse", "one-hot", "drafted head", "q", "misplaced"):
        engine.submit(OpenCmd(key, tuple(prompt), sampling))
        head = tuple(truth[:1]) if case == "drafted head" else ()
        engine.submit(ProposeCmd(key, len(prompt), head, None, max_draft_tokens=4))
        probs = tuple(SparseProbs((d,), (1.0,)) for d in drafts) if case in ("sparse", "q") else None
        assumed = truth[:2] if case == "two assumed" else truth[1:2] if case == "misplaced" else truth[:1]
        start = len(prompt) + (2 if case == "misplaced" else len(assumed))
        engine.submit(ProposeCmd(key, start, drafts, probs, assumed_token_ids=tuple(assumed),
                                 draft_parents=(-1, 0, 0) if case == "tree" else None, max_draft_tokens=4))
        result = engine.step()
        assert result.stats.num_draft_tokens == len(head) and not result.stats.num_folded  # the head alone
        verdicts = [o for o in result.outcomes if isinstance(o, VerdictOut)]
        assert [list(v.token_ids) for v in verdicts] == [truth[:1 + len(head)]]
        return
    out, verdicts, _, stats = _opening(engine, key, prompt, sampling, truth[0], drafts,
                                       ahead_first=case != "late")
    assert out == truth
    folds = case == "coupled"
    assert stats[0].num_draft_tokens == (4 if folds else 0) and stats[0].num_folded == stats[0].num_folds_held == folds
    assert (len([v for v in verdicts if v.step == 0 and not v.finish_reason]) == 1) == folds
    assert engine.blocks.num_used_blocks == 0
