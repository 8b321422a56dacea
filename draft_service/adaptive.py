"""Adaptive draft length per sequence.

Each round picks the k that maximises expected verified tokens per second of this sequence:
    f(k) = (1 - a^(k+1)) / (1 - a)  /  (k * t_draft + t_verify)
with a the sequence's per-token acceptance estimated from its recent rounds (a truncated-geometric estimate:
accepted drafts over accepted drafts plus rejections, exponentially decayed), t_draft the measured seconds per
draft token and t_verify the measured seconds per verification round. t_verify comes from the verifier's own step
time plus the network wait, so it is also the verifier's load hint: a busier verifier makes long drafts cost more,
and a slow network makes them worth more (the best k grows with the round-trip time).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class AdaptiveDraftLength:
    k_max: int
    decay: float = 0.8
    accepted: float = 4.0  # prior: about 0.8 acceptance
    rejected: float = 1.0
    t_draft: float | None = None  # seconds per draft token (EMA)
    t_verify: float | None = None  # seconds per round spent waiting on the verifier (EMA)
    # of the ks whose rate is within this fraction of the best, the largest: near the optimum the rate is flat, and
    # measured on 2 cores its noise alone then cut k = 4 to 2 at one stream with a 20 ms round trip
    tolerance: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float | None, wait_s: float) -> None:
        """draft_s: None where the round's drafting time was not a usual round's (its batch fed a catch-up)."""
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1.0 if num_accepted < num_drafted else 0.0)
        if num_drafted and draft_s is not None:
            per_token = draft_s / num_drafted
            self.t_draft = per_token if self.t_draft is None else 0.7 * self.t_draft + 0.3 * per_token
        self.t_verify = wait_s if self.t_verify is None else 0.7 * self.t_verify + 0.3 * wait_s

    def seeded(self, k_max: int, strength: float = 5.0) -> AdaptiveDraftLength:
        """A new sequence's estimate from this one, pooled over a process's recent rounds: its timings, and its
        acceptance carried by `strength` pseudo-counts (the default prior's), so the sequence's own rounds soon
        outweigh it. A short request on text the draft does not know (acceptance 0.2, say) then starts where the
        requests before it ended, not at the optimistic default that it would spend its few rounds unlearning."""
        total = self.accepted + self.rejected
        scale = strength / total if total > 0 else 1.0
        return dataclasses.replace(self, k_max=k_max, accepted=self.accepted * scale, rejected=self.rejected * scale)

    @classmethod
    def for_mode(cls, k_max: int, mode: str) -> AdaptiveDraftLength:
        """The rule's default state under --speculation `mode`: slower to react under auto."""
        return cls(k_max, decay=0.95, tolerance=0.03) if mode == "auto" else cls(k_max)

    def next_k(self) -> int:
        if self.t_draft is None or self.t_verify is None:
            return self.k_max  # no timings yet: start optimistic, the first rounds measure
        a = min(self.acceptance, 0.999)
        rates = [(1 - a ** (k + 1)) / (1 - a) / (k * self.t_draft + self.t_verify) for k in range(self.k_max + 1)]
        best = max(rates)
        return max(k for k, rate in enumerate(rates) if rate >= best * (1 - self.tolerance))


@dataclass
class RecentChoices:
    """The verifier's latest load choice on this process (RoundLength.load_choice) at each load it came at (the
    generations this process had running then, the choosing one's own included): the length of a new sequence's
    first block (RoundLength.for_mode's recent_choice), drafted ahead for its second round where it opens alone,
    else drafted before its first proposal (RoundLength.opens_ahead). The opening takes the
    latest choice made at a load at least as heavy as its own (the generations running as it opens, its own
    included), or, where the load has risen past every load on record, the latest at the heaviest.

    The latest choice alone misleads where the load rises: a level's (or a burst's) last requests run few to a
    batch, the verifier lets them draft, and the next wave's openings then all drafted ahead, feeding their
    prompts to the draft, at a load the verifier ran plain (bench/capacity.py at 8 and 16 streams, 53371d5: 244
    and 376 prompt rows for 0.30 and 0.08 tokens drafted a verification). One choice a load is kept, however long
    the tail that follows it, and a choice older than `max_age_s` is passed over while a younger one is on record
    (a spike's heavy load an hour ago says little of the acceptance or the verifier now). The load counted is this
    process's generations (any k, those still being prepared included), not the verifier's batch, counted once
    the opening's burst has arrived (Generator._alone: until then the first of a burst that follows a tail took
    the tail's choice).

    The verifier's word on loads not on record (Verdict.plain_from, `note_plain_from`) comes first: an opening
    under a load at least that heavy drafts nothing. At a new, heavier level the record held only a lighter one's
    choices, and a wave's openings drafted those (4 tokens at 16 streams after 8, where the verifier then held a
    step 1.4 s for their drafts and ran plain: bench/capacity.py, default pair, 2 cores, f307590)."""

    max_age_s: float = 60.0
    most_loads: int = 1024  # loads kept; past it the one whose choice is oldest goes
    clock: Callable[[], float] = time.monotonic
    # running -> (record number, when, choice), least recently recorded first
    _latest: dict = field(default_factory=dict)
    _recorded: int = 0
    most_caps: int = 64  # caps whose word is kept; past it the one heard of longest ago goes
    # cap -> (when, the verifier's plain_from) of the latest verdict for a block of that cap, least recent first
    _plain_from: dict = field(default_factory=dict)

    def note_plain_from(self, plain_from: int | None, cap: int) -> None:
        """A verdict's plain_from, for sequences of `cap` (the cap its round asked the verifier about, or a fixed k's
        block). None says nothing (not worked out: a sequence's last verdict, a k = 0 request's, an older
        verifier's, a figure the verifier has not got to yet), and the last word stands."""
        if plain_from is None:
            return
        _put_latest(self._plain_from, cap, (self.clock(), plain_from), self.most_caps)

    def says_plain(self, running: int, cap: int) -> bool:
        """Whether the verifier's latest word on sequences of `cap`, young enough, says it decodes `running` of them
        plainly."""
        word = self._plain_from.get(cap)
        return word is not None and self.clock() - word[0] <= self.max_age_s and running >= word[1]

    def knows(self) -> bool:
        """Whether a choice or a word of the verifier's is on record (a fresh process has neither)."""
        return bool(self._latest or self._plain_from)

    def record(self, running: int, choice: int) -> None:
        self._recorded += 1
        _put_latest(self._latest, running, (self._recorded, self.clock(), choice), self.most_loads)

    def opening(self, running: int, cap: int | None = None) -> int | None:
        """The choice for an opening of `cap` (its k; None: any) with `running` generations on the process (its
        own included): 0 where the verifier's word on that cap says it runs that load plain, else the record's;
        None with neither."""
        if cap is not None and self.says_plain(running, cap):
            return 0
        now = self.clock()
        recent = {seen: latest for seen, latest in self._latest.items() if now - latest[1] <= self.max_age_s}
        recent = recent or self._latest
        if not recent:
            return None
        heavier = [latest for seen, latest in recent.items() if seen >= running]
        return max(heavier)[2] if heavier else recent[max(recent)][2]


def _put_latest(table: dict, key: object, value: object, most: int) -> None:
    """`table[key] = value` as its most recent entry (insertion order), the least recent going past `most`."""
    table.pop(key, None)
    table[key] = value
    if len(table) > most:
        del table[next(iter(table))]


@dataclass
class RoundLength:
    """Each round's draft length for one sequence: at most `k`; under --speculation auto, the verifier's latest
    choice (`choice`, None before its first), or 0 where the own-cost rule says drafting does not pay this
    sequence at all; under adaptive, the own-cost rule's length.

    Under auto, on a process with no other generation running once its burst has arrived (`opens_ahead`;
    Generator._alone), the first round (`opening`)
    proposes no drafts: its empty block goes out with the prompt, so the verifier computes the prompt and samples
    the first token in one step, as for k = 0. Beside that step the draft
    feeds the prompt, guesses the first token and drafts the second round's block after it (`ahead`, a pipelined
    branch, whatever --pipeline says), of the length last chosen on this process at a load at least as heavy as the
    opening's (for_mode's recent_choice: RecentChoices.opening), or none where that was 0 or the verifier's
    plain_from says it runs that load plain (under load: the prompt is
    not warmed either, as after any choice of 0, and the proposal says it is left to feed). When the guess holds,
    the second round's block is at the verifier when the first token is; when it misses, the second round drafts
    after the verdict. That block drafts in a task of its own (Generator._draft_ahead), and the first token goes to
    the client when its verdict arrives. (While the round awaited that drafting first, the first token waited for
    the block: at one stream 1,180 ms against 771 for k = 0 and 1,532 for k = 4, default pair, 2 cores, 2026-12-06.)
    Drafted before the prompt was sent (until 2026-12-06), the first block waited for the draft's prompt and drafts,
    the verifier computed the prompt with no token to emit, and the first token came a step later (one stream,
    default pair, 2 cores: time to first token 1,007 ms against 529 for k = 0; 16 streams, 7.7 s against 5.5). Plain
    with no block drafted ahead (tried the same day), the second round waited for its drafts after the first token:
    at one stream 0.86x fixed k = 4's tokens/s.

    Beside other generations the opening drafts its first block before proposing, as a fixed k does, of the recent
    choice's length (none where that was 0): the prompt and its drafts go in one proposal, which the draft's batch
    sends with the other new sequences' of its burst. Opened the other way under load, a wave's sequences came
    apart: their prompts reached the verifier over two steps as their requests arrived, each group's second round
    came back while the other's step ran, and the batch ran in groups for seconds (bench/capacity.py, abba order,
    default pair, 2 cores, 8bd7d8c: at 8 streams steps of 3, 6, 4, 7, 1, 6 and 2 sequences for 12.5 s, where fixed
    k = 4's openings ran whole from their second round). The opening's drafting delays its first token, which waits
    for the draft's prompt and block as a fixed k's does (at 4 streams, bf43dc8, time to first token p50 2,260 ms
    against fixed k = 4's 2,483 and k = 0's 1,576), so it is kept to openings beside others: alone, the first
    token comes after the prompt's step. Where the process has neither a recent choice nor the verifier's word (a
    fresh service) the opening drafts ahead at the full k whatever the load, as it did before any choice was
    known.

    The own-cost rule (`own`) is this sequence's tokens/s from its acceptance and this service's measured drafting
    and waiting times. Under auto the verifier prices the batch, the network and its wait for drafting, so only
    the rule's 0 is kept: a draft token that costs this sequence more than it saves (text the draft does not know,
    a slow draft beside the verifier on its cores) is not drafted whatever the verifier chose. (As a cap on the
    verifier's choice the rule's length cost the synthetic pair over 20 ms up to 0.12x of k = 4 at 1 to 4
    streams, measured on 2 cores.) Where it says 0, every `probe_every`-th round still drafts one token: the rule
    learns its acceptance and draft time only from drafted rounds, and would otherwise hold 0 for good."""

    k: int
    own: AdaptiveDraftLength | None = None
    follows_verifier: bool = False
    choice: int | None = None
    probe_every: int = 8
    asked: int | None = None  # the cap the last round sent for the verifier's choice (None: none)
    opening: bool = True  # no round yet
    opens_ahead: bool = True  # the opening proposes the prompt alone and drafts its second block ahead (the class)
    ahead: int = 0  # the last round's block drafted ahead beside it (the opening's; see the class)
    _rounds_at_zero: int = 0

    @classmethod
    def for_mode(cls, k: int, mode: str, *, varies: bool, weighs_own_cost: bool, recent_choice: int | None,
                 alone: bool, pooled: AdaptiveDraftLength | None = None) -> RoundLength:
        """`mode`: --speculation; `varies`: whether this sequence's k may vary at all; `recent_choice`: the
        verifier's last choice on this process at a load at least as heavy as this sequence's
        (RecentChoices.opening), so a request that starts under load does not begin with a full-k block;
        `pooled`: the own-cost estimate over this process's recent rounds, the new sequence's starting point
        (AdaptiveDraftLength.seeded); `alone`: no other generation runs on the process (the class's opening)."""
        own = None
        if varies and weighs_own_cost:
            own = (pooled or AdaptiveDraftLength.for_mode(k, mode)).seeded(k)
        follows = varies and mode == "auto"
        choice = recent_choice if follows else None
        return cls(k, own, follows, choice, opens_ahead=alone or choice is None)

    def next_round(self) -> tuple[int, int | None]:
        """(this round's draft length, the cap to send with its proposal for the verifier's choice, or None)."""
        own_cap = self.own.next_k() if self.own else self.k
        if self.follows_verifier and own_cap > 0:
            # the verifier prices the batch, the network and the wait for drafting: the own rule only says
            # whether this sequence's drafting pays at all
            own_cap = self.k
        ask = own_cap
        if own_cap == 0 and self.own is not None:
            self._rounds_at_zero += 1
            if self.probe_every and self._rounds_at_zero % self.probe_every == 0:
                own_cap = 1
            # gated: the round before a probe asks the verifier about one token (asked 0, it would only echo 0
            # back), so its choice says whether its load leaves room for the probe; the other rounds ask 0, so
            # the verifier does not count tokens that will not come
            before_probe = self.probe_every and (self._rounds_at_zero + 1) % self.probe_every == 0
            ask = min(self.k, 1) if before_probe else 0
        else:
            self._rounds_at_zero = 0
        k_round = min(self.k, own_cap if self.choice is None else min(own_cap, self.choice))
        self.ahead = 0
        if self.opening and self.follows_verifier and self.opens_ahead:
            self.ahead, k_round = k_round, 0  # the class's opening
        self.opening = False
        self.asked = ask if self.follows_verifier else None
        return k_round, self.asked

    def load_choice(self, room: int | None) -> int | None:
        """The verifier's latest choice as a word on its load, for the process's next new sequence to start from
        (for_mode's recent_choice); None where it says nothing of the load. `room`: the draft tokens the
        sequence's next block may still hold (what it may still emit, and its context, less the block's own
        correction); None: it ended. The verifier never chooses past that room, so every request's last rounds
        are chosen short, and its last 0, whatever the load: a new request that started from such a choice
        drafted nothing in its first round and fed its prompt to the draft a round later (seen at every level
        of bench/capacity.py; at 8 streams the late ones then came back a round apart from the others, and the
        batch ran in two halves for seconds). Nor is a choice this sequence capped below k itself (the own-cost
        rule's 0, or its 1 before a probe: the verifier can only echo it). A choice under the full k that the room
        did not bound is the verifier's word on its load and the acceptance."""
        if self.choice is None or self.asked != self.k or room is None or room < self.k:
            return None
        return self.choice

    def observe(self, num_drafted: int, num_accepted: int, next_draft_tokens: int | None, draft_s: float | None,
                wait_s: float, timed: bool = True) -> None:
        """`timed`: False for an opening, whose times are its prompt's (and its block's, drafted ahead or before
        it was proposed): the own-cost rule learns nothing from it."""
        if self.follows_verifier:
            self.choice = next_draft_tokens
        if self.own and timed:
            self.own.observe(num_drafted, num_accepted, draft_s, wait_s)
