"""The goodput control inside the verifier engine (in-process, tiny model): which verdicts carry a choice of the
next draft length, what that choice is for an idle and for a loaded verifier (a synthetic step-time model), its
caps, and that the controller forgets every ended sequence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from common.sampling import SamplingParams
from specwire.v1 import wire
from verifier_service.config import VerifierConfig
from verifier_service.server import build_engine, verifier_info
from verifier_service.step_time import StepTimeModel
from verifier_service.types import CloseCmd, ErrorOut, OpenCmd, ProposeCmd, SeqKey, VerdictOut

from tiny_models import greedy_continuation, make_text_pair


@dataclass
class FixedStepTime(StepTimeModel):
    """t(n) = fixed + per_token * n, whatever the steps really took."""

    fixed: float = 0.0
    per_token: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    @property
    def ready(self) -> bool:
        return True

    def predict(self, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens

    def predict_many(self, num_tokens):
        return self.fixed + self.per_token * num_tokens


IDLE = FixedStepTime(fixed=0.05, per_token=1e-6)  # a step's cost hardly grows with its tokens
LOADED = FixedStepTime(fixed=0.0, per_token=0.01)  # compute-bound: every token costs the same


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("goodput"), "qwen2")


def _engine(target, step_time: StepTimeModel | None = None, **kwargs):
    # the controller's own choices, not the trial's arm (wall-clock windows), unless a test asks for the trial
    kwargs.setdefault("speculation_trial", False)
    config = VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=8, num_blocks=256,
                            **kwargs)
    engine = build_engine(config)
    if step_time is not None:
        engine.goodput.step_time = step_time
        engine.goodput.calibrate = False  # the real steps do not follow the synthetic model
        # nor the test loop's pauses between steps a verifier's wait: no idle time is priced (a pause of the loop
        # before a plain step once priced plain decoding above a draft)
        engine.goodput.max_idle_s = 0.0
    if engine.goodput is not None:
        engine.goodput.probe_every = 0  # the choices these tests check are the controller's best, no probes
    return engine, config


def _generate(engine, prompts, n, oracle, *, ask: int | None, first_k: int = 4, max_steps=2000,
              miss_every: int = 0):
    """Greedy generation of n tokens per prompt. Each sequence drafts from `oracle` (the target's own greedy
    continuation, so every draft is accepted) as many tokens as the verifier chose at its last verdict (first_k
    before any), asking with max_draft_tokens=ask; with miss_every, every miss_every-th of its rounds gets its
    first draft wrong (acceptance below 1: with every draft accepted, a draft costs a compute-bound verifier
    nothing, since each drafted token is also an emitted one). Returns the outputs and, per sequence, the draft
    lengths it proposed and the choices it was sent."""
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    keys = [SeqKey(1, i + 1) for i in range(len(prompts))]
    out = {key: [] for key in keys}
    k_next = dict.fromkeys(keys, first_k)
    proposed = {key: [] for key in keys}
    chosen = {key: [] for key in keys}
    for key, prompt in zip(keys, prompts, strict=True):
        engine.submit(OpenCmd(key, tuple(prompt), greedy.with_seed()))
    pending, done = set(), set()
    for _ in range(max_steps):
        for i, key in enumerate(keys):
            if key not in done and key not in pending:
                j = len(out[key])
                drafts = tuple(oracle[i][j:j + k_next[key]])
                if miss_every and drafts and len(proposed[key]) % miss_every == miss_every - 1:
                    drafts = ((drafts[0] + 1) % engine.loaded.vocab_size, *drafts[1:])
                proposed[key].append(len(drafts))
                engine.submit(ProposeCmd(key, len(prompts[i]) + j, drafts, None, max_draft_tokens=ask))
                pending.add(key)
        for o in engine.step().outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, VerdictOut):
                pending.discard(o.key)
                out[o.key].extend(o.token_ids)
                chosen[o.key].append(o.next_draft_tokens)
                if o.next_draft_tokens is not None:
                    k_next[o.key] = o.next_draft_tokens
                if o.finish_reason:
                    done.add(o.key)
        if len(done) == len(keys):
            return [out[k] for k in keys], proposed, chosen
    raise AssertionError("generation did not finish")


PROMPTS = [[5 + i, 9, 11 + i, 4, 8] for i in range(6)]


def _oracle(target, n):
    return [greedy_continuation(target, p, n + 8) for p in PROMPTS]


def test_an_idle_verifier_chooses_the_full_cap(pair):
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    outputs, proposed, chosen = _generate(engine, PROMPTS[:1], 24, _oracle(target, 24)[:1], ask=6)
    (key,) = chosen
    # every choice but the last rounds' (capped by the tokens left to generate) is the draft's cap
    assert chosen[key][0] == 6 and proposed[key][1] == 6
    assert outputs[0] == greedy_continuation(target, PROMPTS[0], 24)


def test_a_loaded_verifier_chooses_plain_decoding_and_the_output_stays_exact(pair):
    target, _ = pair
    n = 12
    engine, _ = _engine(target, LOADED)
    outputs, proposed, chosen = _generate(engine, PROMPTS, n, _oracle(target, n), ask=6, miss_every=2)
    for key in chosen:
        assert chosen[key][-1] is None  # the verdict that ends the sequence chooses nothing
        # once a miss has shown acceptance below 1: k = 0 every round, a token per verdict, as plain decoding
        assert set(chosen[key][1:-1]) == {0}
        assert proposed[key][0] == 4 and set(proposed[key][2:]) == {0}
    assert outputs == [greedy_continuation(target, p, n) for p in PROMPTS]


def test_only_sequences_that_ask_get_a_choice(pair):
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    _, _, chosen = _generate(engine, PROMPTS[:2], 8, _oracle(target, 8)[:2], ask=None)
    assert all(c is None for cs in chosen.values() for c in cs)


def test_the_choice_never_passes_the_cap_the_limit_or_the_tokens_left(pair):
    target, _ = pair
    engine, config = _engine(target, IDLE)
    n = 30
    _, proposed, chosen = _generate(engine, PROMPTS[:1], n, _oracle(target, n)[:1], ask=50)
    (key,) = chosen
    choices = [c for c in chosen[key] if c is not None]
    assert choices[0] == config.max_draft_tokens  # 50 asked, --max-draft-tokens 8 allowed
    # after the verdict that ends at generated tokens g, at most n - g - 1 drafts can still be emitted
    generated = 0
    for k, c in zip(proposed[key], chosen[key], strict=True):
        generated += k + 1
        if generated < n:
            assert c <= n - generated - 1
    assert min(choices) < config.max_draft_tokens  # the tokens left did cap the last rounds


def test_a_pricier_verifier_drafts_less_for_the_same_acceptance(pair):
    """The batch term: the same six sequences, the same acceptance; the choice falls as each extra token
    costs more of the step, from the full cap to plain decoding."""
    target, _ = pair
    n = 24
    lengths = []
    for per_token in (1e-6, 0.005, 1.0):
        engine, _ = _engine(target, FixedStepTime(fixed=0.05, per_token=per_token))
        _, _, chosen = _generate(engine, PROMPTS, n, _oracle(target, n), ask=6, miss_every=2)
        lengths.append(sum(cs[1] for cs in chosen.values()))  # after a round with a miss
    assert lengths[0] == 6 * 6 and lengths[-1] == 0
    assert lengths[0] >= lengths[1] >= lengths[2] and lengths[0] > lengths[2]


def test_ended_sequences_are_forgotten(pair):
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    _generate(engine, PROMPTS[:3], 6, _oracle(target, 6)[:3], ask=4)  # each finishes at max_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True).with_seed()
    key = SeqKey(2, 1)
    engine.submit(OpenCmd(key, tuple(PROMPTS[3]), greedy))
    engine.submit(ProposeCmd(key, len(PROMPTS[3]), (7, 7), None, max_draft_tokens=4))
    engine.step()
    assert key in engine.goodput.acceptance._tried
    engine.submit(CloseCmd(key))  # cancelled halfway
    engine.step()
    assert not engine.goodput.acceptance._tried and not engine.goodput.acceptance._accepted


def test_without_goodput_no_choice_is_sent_and_the_feature_is_not_listed(pair):
    target, _ = pair
    engine, config = _engine(target, goodput=False)
    assert engine.goodput is None
    _, _, chosen = _generate(engine, PROMPTS[:1], 6, _oracle(target, 6)[:1], ask=4)
    assert all(c is None for cs in chosen.values() for c in cs)
    assert wire.FEATURE_GOODPUT not in verifier_info(engine, config).features
    engine, config = _engine(target)
    assert wire.FEATURE_GOODPUT in verifier_info(engine, config).features



def test_the_plain_arm_of_the_trial_sends_zero_and_the_output_stays_exact(pair):
    """While the speculation trial runs its plain arm, every choice is 0 (the idle verifier would choose the cap);
    with --speculation-trial false there is no trial."""
    from verifier_service.speculation_trial import Arm

    target, _ = pair
    engine, _ = _engine(target, IDLE, speculation_trial=True)
    engine.trial.running = Arm.PLAIN
    engine.trial.window_tokens = 10**9  # stays on its plain arm for this test
    outputs, proposed, chosen = _generate(engine, PROMPTS[:2], 12, _oracle(target, 12)[:2], ask=6)
    for key in chosen:
        assert set(chosen[key][:-1]) == {0} and set(proposed[key][1:]) == {0}
    assert outputs == [greedy_continuation(target, p, 12) for p in PROMPTS[:2]]
    engine, _ = _engine(target, IDLE, speculation_trial=False)
    assert engine.trial is None
    _, _, chosen = _generate(engine, PROMPTS[:1], 12, _oracle(target, 12)[:1], ask=6)
    assert chosen[next(iter(chosen))][0] == 6


def test_the_switch_tolerance_and_plain_margin_flags_reach_the_controller(pair):
    target, _ = pair
    default = VerifierConfig(model="m")
    assert _engine(target)[0].goodput.switch_tolerance == default.goodput_switch_tolerance == 0.12
    assert _engine(target)[0].goodput.plain_margin == default.goodput_plain_margin == 0.08
    assert _engine(target, goodput_switch_tolerance=0.25)[0].goodput.switch_tolerance == 0.25
    assert _engine(target, goodput_plain_margin=0.02)[0].goodput.plain_margin == 0.02
    assert _engine(target)[0].goodput.defer_tolerance == default.goodput_defer_tolerance == 0.2
    assert _engine(target, goodput_defer_tolerance=0.4)[0].goodput.defer_tolerance == 0.4


def test_the_trial_is_given_the_predicted_plain_rate(pair):
    """The trial compares what speculation measured with a token a sequence per predicted plain step: 1 / (the
    model's time for a step of the batch's tokens, k = 0), with no idle time priced here."""
    target, _ = pair
    engine, _ = _engine(target, IDLE, speculation_trial=True)
    seen = []
    observe = engine.trial.observe

    def spy(*args, **kwargs):
        seen.append((args[2], kwargs.get("plain_rate")))  # (running sequences, the rate)
        return observe(*args, **kwargs)

    engine.trial.observe = spy
    _generate(engine, PROMPTS[:2], 8, _oracle(target, 8)[:2], ask=4)
    rates = [rate for running, rate in seen if running == 2 and rate is not None]
    assert rates and all(rate == pytest.approx(1.0 / IDLE.predict(2), rel=1e-6) for rate in rates)


def test_the_trial_judges_no_step_while_nothing_running_follows_the_choice(pair):
    """Fixed-k and k = 0 requests alone on an auto verifier: both of the trial's arms would be the same decoding,
    so their steps must not count as the arm in use's windows; the trial sees them as idle time (no sequence
    running), whose clock still ends a challenge. With a sequence that asks running, every step is judged, one
    that verifies only the others while it is away at its draft included; once it stops asking, none is."""
    target, _ = pair
    engine, _ = _engine(target, IDLE, speculation_trial=True)
    seen = []
    observe = engine.trial.observe

    def spy(*args, **kwargs):
        seen.append(args[2])  # the running sequences the trial is told of
        return observe(*args, **kwargs)

    engine.trial.observe = spy
    outputs, _, _ = _generate(engine, PROMPTS[:2], 8, _oracle(target, 8)[:2], ask=None)
    assert seen and set(seen) == {0}
    assert outputs == [greedy_continuation(target, p, 8) for p in PROMPTS[:2]]

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    follower, other = SeqKey(2, 1), SeqKey(3, 1)
    prompts = {follower: PROMPTS[2], other: PROMPTS[3]}
    emitted = {follower: 0, other: 0}
    for key, prompt in prompts.items():
        engine.submit(OpenCmd(key, tuple(prompt), greedy.with_seed()))

    def propose(key, ask):
        engine.submit(ProposeCmd(key, len(prompts[key]) + emitted[key], (), None, max_draft_tokens=ask))

    def step():
        for o in engine.step().outcomes:
            assert not isinstance(o, ErrorOut), o
            if isinstance(o, VerdictOut):
                emitted[o.key] += len(o.token_ids)

    propose(follower, 4)
    propose(other, None)
    while not (emitted[follower] and emitted[other]):
        step()
    seen.clear()
    propose(other, None)  # the follower is away at its draft
    step()
    assert seen == [2]
    propose(follower, None)  # and then stops asking (a fixed-k request)
    propose(other, None)
    step()
    assert seen == [2, 0]


class FixedAcceptance:
    """Every sequence's drafts are accepted at `rate` per position, whatever the verdicts said."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def observe(self, key, num_drafted, num_accepted) -> None:
        pass

    def forget(self, key) -> None:
        pass

    def rates(self, key, k):
        return [self.rate] * k

    group_rates = rates

    def evidence(self, key) -> float:
        return float("inf")

    @staticmethod
    def group_of(key):
        return key.stream_id


def test_a_fragment_of_the_batch_is_priced_with_the_sequences_away_at_their_drafts(pair):
    """16 sequences, acceptance 0.5, a step of 0.5 s + 0.05 s per token: one token drafted per sequence pays
    below 10 sequences in a step and costs above. All 16 were verified together (plain decoding); then 2 come
    back first. Priced alone, their step would draft; under one phase the plan waits for the 14 others, so the
    step priced holds them too, and stays plain. A capped step (two phases: the others are the other phase) is
    priced alone, and so is one without a plan (--phases off), or one whose plan waits for only 2 of the others
    (the rest late). And 8 sequences in one step, below the 10, draft: each is priced once."""
    target, _ = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    prompts = [[5 + i, 9, 11 + i % 7, 4, 8] for i in range(16)]
    keys = [SeqKey(1, i + 1) for i in range(16)]

    def two_back_first(max_verifications, n=16, awaited=tuple(keys[2:])):
        engine, _ = _engine(target, FixedStepTime(fixed=0.5, per_token=0.05))
        engine.goodput.acceptance = FixedAcceptance(0.5)
        engine.goodput.tolerance = 0.0  # the best goodput, not a longer draft near it
        engine.goodput.plain_margin = 0.0  # nor plain decoding near it
        for key, prompt in zip(keys[:n], prompts[:n], strict=True):
            engine.submit(OpenCmd(key, tuple(prompt), greedy))
        done = dict.fromkeys(keys[:n], 0)
        for _ in range(2):  # every sequence in each step (the first computes the prompts too)
            for key, prompt in zip(keys[:n], prompts[:n], strict=True):
                engine.submit(ProposeCmd(key, len(prompt) + done[key], (), None, max_draft_tokens=4,
                                         draft_backlog_tokens=0))  # its draft fed: no switch to price
            outcomes = [o for o in engine.step(None, frozenset()).outcomes if isinstance(o, VerdictOut)]
            assert len(outcomes) == n
            for o in outcomes:
                done[o.key] += len(o.token_ids)
        if n < 10:
            return [o.next_draft_tokens for o in outcomes]
        assert {o.next_draft_tokens for o in outcomes} == {0}  # all 16 in one step: plain decoding
        for key, prompt in zip(keys[:2], prompts[:2], strict=True):
            engine.submit(ProposeCmd(key, len(prompt) + done[key], (), None, max_draft_tokens=4,
                                     draft_backlog_tokens=0))  # its draft fed: no switch to price
        result = engine.step(max_verifications, awaited)
        outcomes = [o for o in result.outcomes if isinstance(o, VerdictOut)]
        assert len(outcomes) == 2 and len(result.stats.chosen_draft_lengths) == 2  # the others' apply later
        return [o.next_draft_tokens for o in outcomes]

    assert two_back_first(None) == [0, 0]
    assert min(two_back_first(2)) >= 1
    assert min(two_back_first(None, awaited=None)) >= 1
    assert min(two_back_first(None, awaited=tuple(keys[2:4]))) >= 1
    assert min(two_back_first(None, n=8)) >= 1


@pytest.mark.parametrize("prompt_len, fixed", [(40, False), (8, False), (40, True)])
def test_a_prompt_arriving_beside_plain_decoding_is_priced_once_not_as_the_next_step_s_work(pair, prompt_len, fixed):
    """12 sequences decode plainly (acceptance 0.5, a step of 0.5 s + 0.05 s per token: one token drafted each
    costs goodput at 12). A new request's prompt in their step comes once: the next step holds their blocks alone,
    and stays plain. Priced as the next step's work, even 7 prompt tokens made drafting look cheap beside them.
    The same for a fixed-k request whose first block comes with its prompt (a verification that follows no
    choice: its block, 1 + k, comes again). (A chunk of a prompt not done yet is work the next step has again:
    test_the_tokens_a_step_item_feeds_again.)"""
    target, _ = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    prompts = [[5 + i, 9, 11 + i % 7, 4, 8] for i in range(12)]
    keys = [SeqKey(1, i + 1) for i in range(12)]
    engine, _ = _engine(target, FixedStepTime(fixed=0.5, per_token=0.05))
    engine.goodput.acceptance = FixedAcceptance(0.5)
    engine.goodput.tolerance = 0.0
    engine.goodput.plain_margin = 0.0
    engine.goodput.switch_tolerance = 0.0  # nor the hysteresis that keeps plain decoding once chosen
    for key, prompt in zip(keys, prompts, strict=True):
        engine.submit(OpenCmd(key, tuple(prompt), greedy))
    done = dict.fromkeys(keys, 0)

    def step() -> list[int | None]:
        for key, prompt in zip(keys, prompts, strict=True):
            engine.submit(ProposeCmd(key, len(prompt) + done[key], (), None, max_draft_tokens=4))
        result = engine.step()
        outcomes = [o for o in result.outcomes if isinstance(o, VerdictOut) and o.key in done]
        assert len(outcomes) == 12, result.stats
        for o in outcomes:
            done[o.key] += len(o.token_ids)
        return [o.next_draft_tokens for o in outcomes]

    step()
    assert set(step()) == {0}  # the 12 alone: plain decoding
    new = tuple(range(3, 3 + prompt_len))
    engine.submit(OpenCmd(SeqKey(1, 99), new, greedy))  # no proposal yet: a prefill chunk
    if fixed:  # its first block of 2 with it, asking for no choice
        engine.submit(ProposeCmd(SeqKey(1, 99), len(new), (1, 2), None, max_draft_tokens=None))
    assert set(step()) == {0}


def test_the_tokens_a_step_item_feeds_again_next_step():
    from types import SimpleNamespace

    from verifier_service.engine import _recurring_tokens
    from verifier_service.types import ScheduledSeq
    seq = SimpleNamespace(num_tokens=100)
    assert _recurring_tokens(ScheduledSeq(seq, 0, 60, None, num_prefill_tokens=60)) == 39  # the rest of the prompt
    assert _recurring_tokens(ScheduledSeq(seq, 60, 99, None, num_prefill_tokens=39)) == 0  # its last chunk
    assert _recurring_tokens(ScheduledSeq(seq, 0, 30, None, num_prefill_tokens=30)) == 30  # at most a chunk's size
    proposal = SimpleNamespace(num_draft_tokens=4)
    # a fixed-k verification with the rest of its prompt (40 of it): 1 + 4 again
    assert _recurring_tokens(ScheduledSeq(seq, 59, 104, proposal, num_prefill_tokens=40)) == 5


def test_the_engine_forgets_an_ended_sequences_next_block(pair):
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True).with_seed()
    key = SeqKey(3, 1)
    engine.submit(OpenCmd(key, tuple(PROMPTS[0]), greedy))
    engine.submit(ProposeCmd(key, len(PROMPTS[0]), (7, 7), None, max_draft_tokens=4))
    engine.step(None, frozenset())
    assert key in engine._next_blocks
    engine.submit(CloseCmd(key))  # cancelled halfway
    engine.step(None, frozenset())
    assert key not in engine._next_blocks


def test_the_drafting_observed_is_the_slowest_draft_batch_with_its_own_rows():
    """Blocks of one stream that carry the same draft_seconds came from one batch: the controller sees the slowest
    batch's time, its longest block and the tokens it drafted (not another batch's of the same stream, nor other
    streams' tokens), and a block without a model's time (an n-gram one) is not drafting."""
    from types import SimpleNamespace

    from verifier_service.engine import VerifierEngine

    def block(stream: int, seq: int, k: int, seconds: float | None) -> SimpleNamespace:
        return SimpleNamespace(proposal=ProposeCmd(SeqKey(stream, seq), 10, tuple(range(5, 5 + k)), None,
                                                   draft_seconds=seconds))

    seen = []

    class Control:
        max_draft_s = 5.0

        def observe_drafting(self, *args, **kwargs) -> None:
            seen.append(args + ((kwargs,) if kwargs else ()))

    verifications = [block(1, 1, 4, 0.3), block(1, 2, 2, 0.3), block(1, 3, 3, 0.1), block(2, 1, 4, 0.2),
                     block(2, 2, 0, 0.9), block(3, 1, 6, None)]
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=verifications), Control())
    assert seen == [(0.3, 4, True, 6)]
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[block(1, 1, 2, 9.0)]), Control())
    assert seen[-1] == (5.0, 2, True, 2)  # a claim counts at most max_draft_s
    # a batch that fed a catch-up first is observed with its catch-up where the step waited for it (the slowest);
    # a faster one leaves the others' slowest batch observed
    def caught_up(seconds: float) -> SimpleNamespace:
        return SimpleNamespace(proposal=dataclasses.replace(block(2, 1, 4, seconds).proposal, catch_up_tokens=30))

    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[*verifications[:3], caught_up(1.5)]), Control())
    assert seen[-1] == (1.5, 4, True, 4, {"catch_up_tokens": 30, "batch": (2, 1.5)})
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[*verifications[:3], caught_up(0.2)]), Control())
    assert seen[-1] == (0.3, 4, True, 6)
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[caught_up(0.2)]), Control())
    assert seen[-1] == (0.2, 4, True, 4, {"catch_up_tokens": 30, "batch": (2, 0.2)})
    # its empty blocks (deferred for their own catch-up) belong to it too
    deferred = SimpleNamespace(proposal=dataclasses.replace(block(2, 2, 0, 0.2).proposal, catch_up_tokens=30))
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[deferred, caught_up(0.2)]), Control())
    assert seen[-1] == (0.2, 4, True, 4, {"catch_up_tokens": 30, "batch": (2, 0.2)})
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[verifications[2], deferred]), Control())
    # the wait was for it, not for stream 1's
    assert seen[-1] == (0.2, 0, True, 0, {"catch_up_tokens": 30, "batch": (2, 0.2)})
    # claims past max_draft_s tie, whatever their blocks: the catch-up batch is the slowest among equals
    VerifierEngine._observe_drafting(SimpleNamespace(verifications=[block(1, 1, 6, 9.0), caught_up(6.0)]), Control())
    assert seen[-1] == (5.0, 4, True, 4, {"catch_up_tokens": 30, "batch": (2, 6.0)})


def test_the_engine_gives_the_choice_each_sequence_s_context_and_tokens_left(pair):
    """What prices a sequence's catch-up (DraftLengthController.catch_up_rows): its context now and the tokens it
    may still emit, for each sequence that asked for a choice."""
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    seen = []
    choose = engine.goodput.choose
    engine.goodput.choose = lambda *a, **kw: seen.append(dict(kw["sizes"])) or choose(*a, **kw)
    n = 10
    outputs, proposed, _ = _generate(engine, PROMPTS[:1], n, _oracle(target, n)[:1], ask=2)
    (key,) = (SeqKey(1, 1),)
    generated = 0
    assert len(seen) >= 2
    for sizes, k in zip(seen, proposed[key], strict=False):
        generated += k + 1
        assert sizes == {key: (len(PROMPTS[0]) + generated, n - generated)}


def test_a_choice_the_plain_margin_turns_is_logged_and_counted(pair):
    """8 sequences, acceptance 0.5, a step of 0.5 s + 0.05 s per token: a token drafted each gains about 3.7 % over
    plain decoding. The default margin (8 %) turns that to plain decoding, and the step says so (its stats, the
    counter); with no margin it drafts, and nothing is counted."""
    from verifier_service.metrics import VerifierMetrics

    target, _ = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    prompts = [[5 + i, 9, 11 + i % 7, 4, 8] for i in range(8)]
    keys = [SeqKey(1, i + 1) for i in range(8)]

    def second_step(**kw):
        engine, _ = _engine(target, FixedStepTime(fixed=0.5, per_token=0.05), **kw)
        engine.goodput.acceptance = FixedAcceptance(0.5)
        engine.goodput.tolerance = 0.0
        for key, prompt in zip(keys, prompts, strict=True):
            engine.submit(OpenCmd(key, tuple(prompt), greedy))
        done = dict.fromkeys(keys, 0)
        for _ in range(2):
            for key, prompt in zip(keys, prompts, strict=True):
                engine.submit(ProposeCmd(key, len(prompt) + done[key], (), None, max_draft_tokens=4,
                                         draft_backlog_tokens=0))  # its draft fed: no switch to price
            result = engine.step(None, frozenset())
            for o in result.outcomes:
                if isinstance(o, VerdictOut):
                    done[o.key] += len(o.token_ids)
        return result.stats

    declined = second_step()
    assert not any(declined.chosen_draft_lengths) and 0.02 < declined.declined_gain < 0.05
    assert declined.predicted_goodput == pytest.approx(declined.predicted_plain_goodput)
    drafting = second_step(goodput_plain_margin=0.0)
    assert all(drafting.chosen_draft_lengths) and drafting.declined_gain is None
    assert drafting.predicted_goodput > drafting.predicted_plain_goodput
    metrics = VerifierMetrics()
    for stats in (declined, drafting):
        metrics.observe_step(stats)
    assert metrics.registry.get_sample_value("specwire_goodput_plain_margin_declined_total") == 1


def test_the_draft_s_word_on_its_backlog_reaches_the_choice(pair):
    """An opening (the prompt, an empty block) that says the draft has nothing left to feed (it drafts the next
    block ahead, or warms the prompt) is priced with no catch-up; one that says nothing (an older draft) is priced
    as a sequence that never drafted, its whole context; one that says what is left pays that."""
    target, _ = pair
    engine, _ = _engine(target, IDLE)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True).with_seed()
    said, unsaid, left = SeqKey(1, 1), SeqKey(1, 2), SeqKey(1, 3)
    for i, (key, backlog) in enumerate(((said, 0), (unsaid, None), (left, 3))):
        engine.submit(OpenCmd(key, tuple(PROMPTS[i] * 4), greedy))
        engine.submit(ProposeCmd(key, 20, (), None, max_draft_tokens=4, draft_backlog_tokens=backlog))
    verdicts = [o for o in engine.step().outcomes if isinstance(o, VerdictOut)]
    assert len(verdicts) == 3
    control = engine.goodput
    assert control._backlog == {said: 0, left: 3}
    rates = (0.5, 0.5)
    assert control.catch_up_rows(said, rates, 21, 15) == 0.0
    assert control.catch_up_rows(unsaid, rates, 21, 15) == pytest.approx(21 / (15 / 1.75))
    assert control.catch_up_rows(left, rates, 21, 15) == 0.0  # within what a round feeds anyway


def test_verdicts_of_sequences_with_a_cap_carry_their_stream_s_plain_from(pair):
    """Verdict.plain_from: the verdicts of a sequence that asks for a choice and of a fixed k's on its stream carry
    the stream's plain_from for their cap (the draft opens its next sequences by it, and a load only fixed-k
    requests ran at is one the model has seen); a k = 0 request's, which drafts nothing, carry none, nor does
    anything on a stream that never asked for a choice; the step logs the lowest. One figure is worked out a step,
    those never worked out first: the fixed k's cap gets its figure a step after the auto request's."""
    target, _ = pair
    engine, _ = _engine(target, FixedStepTime(fixed=0.5, per_token=0.05))
    engine.goodput.acceptance = FixedAcceptance(0.5)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    auto, fixed, plain, elsewhere = SeqKey(1, 1), SeqKey(1, 2), SeqKey(1, 3), SeqKey(2, 4)
    for key, prompt in zip((auto, fixed, plain, elsewhere), PROMPTS, strict=False):
        engine.submit(OpenCmd(key, tuple(prompt), greedy))
    engine.submit(ProposeCmd(auto, len(PROMPTS[0]), (), None, max_draft_tokens=4))
    engine.submit(ProposeCmd(fixed, len(PROMPTS[1]), (7, 8, 9), None))
    engine.submit(ProposeCmd(plain, len(PROMPTS[2]), (), None))
    engine.submit(ProposeCmd(elsewhere, len(PROMPTS[3]), (7, 8, 9), None))  # a fixed k's stream alone
    result = engine.step(None, frozenset())
    outcomes = {o.key: o for o in result.outcomes if isinstance(o, VerdictOut)}
    four, three = engine.goodput.plain_from(auto, 4), engine.goodput.plain_from(fixed, 3)
    assert four is not None and three is not None and 1 < min(three, four) < 256
    assert (outcomes[auto].plain_from, outcomes[fixed].plain_from, result.stats.plain_from) == (four, None, four)
    assert outcomes[plain].plain_from is None and outcomes[auto].next_draft_tokens is not None
    assert outcomes[elsewhere].plain_from is None
    engine.submit(ProposeCmd(auto, len(PROMPTS[0]) + len(outcomes[auto].token_ids), (), None, max_draft_tokens=4))
    engine.submit(ProposeCmd(fixed, len(PROMPTS[1]) + len(outcomes[fixed].token_ids), (7, 8, 9), None))
    result = engine.step(None, frozenset())
    outcomes = {o.key: o for o in result.outcomes if isinstance(o, VerdictOut)}
    assert (outcomes[auto].plain_from, outcomes[fixed].plain_from, result.stats.plain_from) == (
        four, three, min(three, four))


def test_a_folded_opening_s_two_verdicts_both_carry_plain_from():
    """split_folded: the first token's verdict and the folded block's both carry the figure (the draft notes each)."""
    from verifier_service.types import split_folded

    folded = VerdictOut(SeqKey(1, 1), 5, 3, (7, 8, 9, 10), None, 4, 0.2, next_draft_tokens=2, split=1,
                        plain_from=12)
    first, rest = split_folded(folded)
    assert (first.token_ids, rest.token_ids) == ((7,), (8, 9, 10))
    assert first.plain_from == rest.plain_from == 12


def test_a_batch_of_unfed_prompts_is_held_by_the_switch_and_defer_tolerances(pair):
    """16 sequences after their prompts' step, acceptance 0.8, a step of 0.7 s + 0.05 s per token: drafting (2 or 3
    tokens a sequence) gains about 15 % over plain decoding (the stats' declined gain), between the switch tolerance (12 %) and
    the defer tolerance (20 %). Openings whose drafts fed the prompts (Proposal.draft_backlog_tokens 0) draft.
    Openings that left their drafts the prompts to feed (most of the step's sequences unfed: a switch, held to
    12 %; 16 catch-ups of 10 rows, which one draft batch would not feed at once: held to 20 %) stay plain; with a
    defer tolerance at the switch tolerance's, they draft, as they do from 16 draft processes of one each."""
    target, _ = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_seed()
    prompts = [[5 + i, 9, 11 + i % 7, 4, 8, 3, 6 + i % 5, 12, 7, 10] for i in range(16)]

    def second_choice(backlog: int, processes: int = 1, **kw):
        engine, _ = _engine(target, FixedStepTime(fixed=0.7, per_token=0.05), **kw)
        engine.goodput.acceptance = FixedAcceptance(0.8)
        keys = [SeqKey(1 + i % processes, i + 1) for i in range(16)]
        for key, prompt in zip(keys, prompts, strict=True):
            engine.submit(OpenCmd(key, tuple(prompt), greedy))
            engine.submit(ProposeCmd(key, len(prompt), (), None, max_draft_tokens=4,
                                     draft_backlog_tokens=backlog))
        return engine.step(None, frozenset()).stats

    fed = second_choice(0)
    assert all(fed.chosen_draft_lengths) and fed.declined_gain is None
    unfed = len(prompts[0]) - 1  # what a draft that did not feed the prompt says (its last token is fed drafting)
    held = second_choice(unfed)
    assert not any(held.chosen_draft_lengths) and 0.13 < held.declined_gain < 0.18
    assert all(second_choice(unfed, goodput_defer_tolerance=0.12).chosen_draft_lengths)
    assert all(second_choice(unfed, processes=16).chosen_draft_lengths)
