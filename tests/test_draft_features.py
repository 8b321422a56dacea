"""Adaptive draft length, confidence early stop and n-gram drafting: units, and end-to-end exactness through
extra draft services attached to the same verifier."""

from __future__ import annotations

import dataclasses

import pytest
from test_e2e import PROMPTS

import specwire
from draft_service.adaptive import AdaptiveDraftLength
from draft_service.ngram import propose_ngram
from specwire.launch import Stack

from tiny_models import greedy_continuation


def test_ngram_proposes_what_followed_the_longest_recent_match():
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert propose_ngram(seq, 3) == [4, 5, 9]
    assert propose_ngram([7, 8, 7], 2) == [8, 7]  # falls back to a 1-gram
    assert propose_ngram([1, 2, 3], 4) == []
    assert propose_ngram(seq, 0) == []


def test_adaptive_k_follows_acceptance_and_costs():
    high = AdaptiveDraftLength(k_max=8)
    low = AdaptiveDraftLength(k_max=8)
    for _ in range(20):
        high.observe(4, 4, draft_s=0.04, wait_s=0.25)
        low.observe(4, 0, draft_s=0.04, wait_s=0.25)
    assert high.acceptance > 0.9 and low.acceptance < 0.2
    assert high.next_k() > low.next_k()
    slow_network = AdaptiveDraftLength(k_max=8, accepted=3.0, rejected=1.0, t_draft=0.05, t_verify=0.05)
    fast_network = AdaptiveDraftLength(k_max=8, accepted=3.0, rejected=1.0, t_draft=0.05, t_verify=2.0)
    assert fast_network.next_k() > slow_network.next_k()  # a costly round makes longer drafts worth it


@pytest.fixture(scope="module")
def extra_drafts(text_stack):
    with Stack() as stack:
        common = ["draft", "--model", str(text_stack.draft_dir), "--dtype", "float64", "--verifier",
                  text_stack.verifier, "--block-size", "4"]
        # a fixed k: these tests check what prompt lookup proposes (under auto, the verifier may choose k = 0 for
        # a stream whose earlier sampled requests were rarely accepted)
        ngram = stack.start("ngram", [*common, "--proposer", "ngram", "--num-speculative-tokens", "4",
                                      "--speculation", "fixed"], log_dir=text_stack.log_dir, timeout_s=120)
        adaptive = stack.start("adaptive", [*common, "--adaptive-k", "--num-speculative-tokens", "8",
                                            "--draft-confidence-threshold", "0.3"], log_dir=text_stack.log_dir,
                               timeout_s=120)
        yield {"ngram": ngram.address, "adaptive": adaptive.address}


@pytest.mark.parametrize("kind", ["ngram", "adaptive"])
def test_greedy_output_is_exact(text_stack, extra_drafts, kind):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_stack.target_dir)
    prompts = [*PROMPTS[:2], "for i in range(10):\n    for i in range(10):\n        for i in range("]
    with specwire.Client(extra_drafts[kind]) as client:
        for prompt in prompts:
            r = client.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
            assert r.token_ids == greedy_continuation(text_stack.target_dir, tok.encode(prompt), 20), (kind, prompt)
    assert text_stack.metric("specwire_kv_blocks_used") == 0


def test_ngram_sampling_is_seeded_and_drafts_get_accepted(text_stack, extra_drafts):
    prompt = "a b c d e a b c d e a b c d e a b c d e"
    with specwire.Client(extra_drafts["ngram"]) as client:
        one = client.generate(prompt, max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)
        two = client.generate(prompt, max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)
        greedy = client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert one.token_ids == two.token_ids
    assert greedy.stats.num_draft_tokens > 0


@pytest.mark.parametrize("mode", [{"adaptive_k": True}, {"speculation": "adaptive"}, {"speculation": "auto"}, {}])
def test_seeded_sampled_requests_keep_a_fixed_k_under_adaptive_k(mode):
    """Under --speculation auto (the default) and adaptive alike."""
    from common.sampling import SamplingParams, WireMode
    from draft_service.config import DraftConfig
    from draft_service.generation import Generator

    gen = Generator(DraftConfig(model="m", **mode), tokenizer=None, vocab_size=10, link=None, drafter=None)

    def request(wire_mode=WireMode.SPARSE, **sampling):
        return SamplingParams(**sampling, wire_mode=wire_mode)

    assert gen.adapts_k(request(temperature=0.8), 4)  # unseeded: adapt
    assert gen.adapts_k(request(temperature=0.0, seed=3), 4)  # greedy: output does not depend on k
    assert not gen.adapts_k(request(temperature=0.8, seed=3), 4)  # seeded sampling: fixed k, reproducible
    assert not gen.adapts_k(request(WireMode.ONE_HOT, temperature=0.8, seed=3), 4)
    assert gen.adapts_k(request(WireMode.COUPLED, temperature=0.8, seed=3), 4)  # coupled: does not depend on k
    assert not gen.adapts_k(request(temperature=0.8), 0)


def test_a_fixed_k_never_varies():
    from common.sampling import SamplingParams, WireMode
    from draft_service.config import DraftConfig
    from draft_service.generation import Generator

    gen = Generator(DraftConfig(model="m", speculation="fixed"), tokenizer=None, vocab_size=10, link=None,
                    drafter=None)
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)):
        assert not gen.adapts_k(sampling, 4)
        assert not gen.adapts_k(dataclasses.replace(sampling, wire_mode=WireMode.COUPLED), 4)


def test_seeded_sampling_is_reproducible_through_an_adaptive_draft(text_stack, extra_drafts):
    kwargs = dict(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)
    with specwire.Client(extra_drafts["adaptive"]) as client:
        one = client.generate("The quick brown fox", **kwargs)
        two = client.generate("The quick brown fox", **kwargs)
    assert one.token_ids == two.token_ids


def test_the_coupled_mode_needs_a_verifier_that_lists_it():
    from common.errors import ErrorCode, ServiceError
    from common.sampling import SamplingParams, WireMode
    from draft_service.config import DraftConfig
    from draft_service.generation import Generator
    from draft_service.types import VerifierIdentity

    gen = Generator(DraftConfig(model="m"), tokenizer=None, vocab_size=10, link=None, drafter=None)
    old = VerifierIdentity("t", 10, "ab" * 32, 8, 100, features=())
    new = VerifierIdentity("t", 10, "ab" * 32, 8, 100, features=("coupled",))
    coupled = SamplingParams(temperature=0.8, seed=1, wire_mode=WireMode.COUPLED)
    with pytest.raises(ServiceError) as err:
        gen._sampling(coupled, old)
    assert err.value.code is ErrorCode.FAILED_PRECONDITION and "coupled" in err.value.message
    assert gen._sampling(coupled, new).is_coupled
    assert not gen._sampling(dataclasses.replace(coupled, wire_mode=WireMode.SPARSE), new).is_coupled
    greedy = SamplingParams(temperature=0.0, wire_mode=WireMode.COUPLED)
    assert not gen._sampling(greedy, old).is_coupled  # greedy: argmax, on any verifier


def test_the_own_cost_rule_takes_the_longest_k_near_its_optimum():
    """Near its optimum the rate is flat in k: a tolerance takes the longest k within it (--speculation auto),
    where noise in the estimates alone would otherwise shorten the draft."""
    from draft_service.adaptive import AdaptiveDraftLength

    state = dict(accepted=2.8, rejected=2.2, t_draft=0.005, t_verify=0.06)  # acceptance 0.56, a 20 ms round trip
    assert AdaptiveDraftLength(4, **state).next_k() == 3
    assert AdaptiveDraftLength(4, tolerance=0.03, **state).next_k() == 4
    # a draft that costs as much as the verification still gets a short k, tolerance or not
    costly = dict(state, t_draft=0.06)
    assert AdaptiveDraftLength(4, tolerance=0.03, **costly).next_k() <= 1


def test_the_own_cost_rule_drafts_nothing_but_probes_where_drafting_costs_more_than_it_saves():
    """Under auto the verifier prices a draft's model time, not what drafting costs a process beside it on the
    same cores: where one draft token costs this sequence more than it saves (acceptance 0.15 here), the round
    drafts nothing whatever the verifier would choose, except every 8th, which drafts one to measure again, as
    long as the verifier (asked about one token the round before) has room for it."""
    from draft_service.adaptive import AdaptiveDraftLength, RoundLength

    own = AdaptiveDraftLength(4, accepted=0.3, rejected=1.7, t_draft=0.3, t_verify=1.0, decay=0.95, tolerance=0.03)

    def rounds(length: RoundLength, verifier_would: int, n: int = 16) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            k, cap = length.next_round()
            out.append((k, cap))
            # the verifier's choice never exceeds the cap asked; these rounds leave the estimate as it is
            length.choice = min(cap, verifier_would)
        return out

    gated = rounds(RoundLength(4, dataclasses.replace(own), follows_verifier=True, choice=3, opening=False), verifier_would=3)
    assert [k for k, _ in gated] == [0] * 7 + [1] + [0] * 7 + [1]
    assert [cap for _, cap in gated] == ([0] * 6 + [1, 0]) * 2  # asks about one token only before a probe
    loaded = rounds(RoundLength(4, dataclasses.replace(own), follows_verifier=True, choice=3, opening=False), verifier_would=0)
    assert [k for k, _ in loaded][1:] == [0] * 15  # under load the verifier's 0 holds the probe back too
    # where drafting pays this sequence at all, the verifier's choice, not the rule's own length (here 1)
    paying = dataclasses.replace(own, accepted=1.0, rejected=1.0)
    assert paying.next_k() == 1
    assert rounds(RoundLength(4, paying, follows_verifier=True, choice=3, opening=False), verifier_would=3, n=2) == [(3, 4)] * 2
    assert RoundLength(4, paying).next_round() == (1, None)  # --speculation adaptive: the rule alone


def test_a_new_sequence_starts_from_the_processs_recent_acceptance():
    """The own-cost estimate pooled over a process's rounds seeds a new sequence's: a short request on text the
    draft does not know starts low, not at the optimistic default, and its own rounds soon outweigh the pool."""
    from draft_service.adaptive import AdaptiveDraftLength, RoundLength

    pooled = AdaptiveDraftLength(4, decay=0.95, tolerance=0.03)
    for _ in range(40):
        pooled.observe(4, 0, draft_s=0.4, wait_s=1.0)
    fresh = RoundLength.for_mode(4, "auto", varies=True, weighs_own_cost=True, recent_choice=4, alone=True)
    seeded = RoundLength.for_mode(4, "auto", varies=True, weighs_own_cost=True, recent_choice=4, alone=True,
                                  pooled=pooled)
    # (under auto the opening proposes no drafts, and drafts the next block ahead at the rule's length)
    assert fresh.next_round() == (0, 4) and fresh.ahead == 4
    assert seeded.next_round() == (0, 0) and seeded.ahead == 0
    assert seeded.own.accepted + seeded.own.rejected == pytest.approx(5.0)  # the default prior's weight
    assert seeded.own.t_draft == pooled.t_draft and seeded.own.k_max == 4
    for _ in range(6):
        seeded.own.observe(4, 4, draft_s=0.04, wait_s=1.0)
    assert seeded.next_round()[0] == 4


def test_an_opening_beside_other_generations_drafts_its_block_before_proposing():
    """Under auto an opening proposes its prompt alone and drafts ahead only where no other generation runs on
    the process (or no choice is on record yet, a fresh service): beside others it drafts the recent choice first,
    as a fixed k does, and a recent choice of 0 leaves the prompt alone with nothing ahead."""
    from draft_service.adaptive import RoundLength

    def opening(recent, alone):
        length = RoundLength.for_mode(4, "auto", varies=True, weighs_own_cost=False, recent_choice=recent,
                                      alone=alone)
        return length.next_round(), length.ahead, length.next_round()

    assert opening(3, alone=True) == ((0, 4), 3, (3, 4))
    assert opening(3, alone=False) == ((3, 4), 0, (3, 4))
    assert opening(0, alone=False) == ((0, 4), 0, (0, 4))
    assert opening(None, alone=False) == ((0, 4), 4, (4, 4))
    # a fixed k, and a sequence whose k may not vary, draft their k from the first round whatever the load
    fixed = RoundLength.for_mode(4, "fixed", varies=True, weighs_own_cost=False, recent_choice=3, alone=True)
    assert fixed.next_round() == (4, None) and fixed.ahead == 0
    steady = RoundLength.for_mode(4, "auto", varies=False, weighs_own_cost=False, recent_choice=3, alone=True)
    assert steady.next_round() == (4, None) and steady.ahead == 0


def test_an_opening_s_times_teach_the_own_cost_rule_nothing():
    """An opening's round takes its prompt's and its block-ahead's time, not a round's: observed untimed, the
    own-cost rule's times stay as they were, while the verifier's choice is still taken."""
    from draft_service.adaptive import AdaptiveDraftLength, RoundLength

    own = AdaptiveDraftLength(4, t_draft=0.01, t_verify=0.2)
    length = RoundLength(4, own, follows_verifier=True)
    length.observe(0, 0, 3, draft_s=2.0, wait_s=0.0, timed=False)
    assert (own.t_draft, own.t_verify, length.choice) == (0.01, 0.2, 3)
    length.observe(0, 0, 2, draft_s=None, wait_s=0.0)
    assert own.t_verify == pytest.approx(0.14) and length.choice == 2


def test_an_opening_takes_the_latest_choice_made_at_a_load_at_least_its_own():
    """RecentChoices: the latest choice made with at least the opening's generations running on the process; where
    the load has risen past every load on record, the latest at the heaviest; None before any. A burst's last
    requests, few to a batch, may draft where a full batch ran plain: their choices, however many, do not decide
    the next full batch's openings."""
    from draft_service.adaptive import RecentChoices

    recent = RecentChoices(most_loads=4)
    assert recent.opening(1) is None
    for _ in range(3):
        recent.record(8, 0)  # a full batch, plain
    recent.record(7, 3)
    for _ in range(200):  # its long tail, drafting
        recent.record(2, 4)
        recent.record(1, 4)
    assert recent.opening(8) == 0 and recent.opening(7) == 3 and recent.opening(3) == 3
    assert recent.opening(2) == 4 and recent.opening(1) == 4
    assert recent.opening(16) == 0  # heavier than any on record: the heaviest's
    recent.record(8, 3)  # the full batch drafts again
    assert recent.opening(8) == 3 and recent.opening(16) == 3
    recent.record(4, 2)  # a fifth load: the one whose choice is oldest goes (7)
    assert sorted(recent._latest) == [1, 2, 4, 8]
    assert recent.opening(16) == 3 and recent.opening(5) == 3  # the heaviest load's latest, not the latest overall
    recent.record(5, 1)
    assert sorted(recent._latest) == [1, 4, 5, 8]


def test_an_opening_passes_over_choices_older_than_a_minute_while_younger_ones_are_on_record():
    """A heavy load's choice from long ago (a spike) does not decide openings now, while younger choices are on
    record; with none younger, the old ones still serve."""
    from draft_service.adaptive import RecentChoices

    now = [0.0]
    recent = RecentChoices(max_age_s=60.0, clock=lambda: now[0])
    recent.record(50, 0)  # a spike, plain
    now[0] = 30.0
    recent.record(8, 4)
    assert recent.opening(16) == 0  # the spike's load is heavier, and young enough
    now[0] = 61.0
    assert recent.opening(16) == 4 and recent.opening(50) == 4  # past its age: the heaviest younger one
    now[0] = 200.0
    assert recent.opening(16) == 0  # none younger: the old ones serve as they are


def test_an_opening_at_a_load_the_verifier_would_run_plain_drafts_nothing():
    """RecentChoices with the verifier's plain_from (Verdict.plain_from), one word a cap: an opening of that k
    under a load at least that heavy takes 0 whatever the record says, a lighter one (or one of another k) the
    record's choice; a verdict without one (not worked out) leaves it, and a word older than max_age_s is passed
    over."""
    from draft_service.adaptive import RecentChoices

    now = [0.0]
    recent = RecentChoices(max_age_s=60.0, clock=lambda: now[0])
    assert not recent.knows()
    recent.note_plain_from(None, 4)  # not worked out: nothing known yet
    assert not recent.knows()
    recent.note_plain_from(12, 4)
    assert recent.knows()
    assert recent.opening(16, 4) == 0 and recent.opening(12, 4) == 0  # before any choice too
    assert recent.opening(11, 4) is None and recent.opening(16, 2) is None and recent.opening(16) is None
    recent.record(8, 4)
    assert recent.opening(16, 4) == 0 and recent.opening(12, 4) == 0 and recent.opening(11, 4) == 4
    recent.note_plain_from(6, 1)  # a round that asked for one token (the own-cost rule's probe): another cap
    assert recent.opening(11, 4) == 4 and recent.opening(11, 1) == 0
    now[0] = 61.0
    assert recent.opening(16, 4) == 4  # the word is too old: the heaviest choice on record
    recent.note_plain_from(12, 4)
    recent.note_plain_from(None, 4)  # a last verdict, a k = 0 request's, a figure not yet got to: no news
    assert recent.opening(16, 4) == 0 and recent.says_plain(12, 4) and not recent.says_plain(11, 4)
    recent.note_plain_from(257, 4)  # drafting pays at every load the verifier looked at
    assert recent.opening(16, 4) == 4 and not recent.says_plain(256, 4)
    small = RecentChoices(most_caps=2)
    for cap in (1, 2, 3):
        small.note_plain_from(5, cap)
    assert sorted(small._plain_from) == [2, 3]
