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

from dataclasses import dataclass


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

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, wait_s: float) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1.0 if num_accepted < num_drafted else 0.0)
        if num_drafted:
            per_token = draft_s / num_drafted
            self.t_draft = per_token if self.t_draft is None else 0.7 * self.t_draft + 0.3 * per_token
        self.t_verify = wait_s if self.t_verify is None else 0.7 * self.t_verify + 0.3 * wait_s

    def next_k(self) -> int:
        if self.t_draft is None or self.t_verify is None:
            return self.k_max  # no timings yet: start optimistic, the first rounds measure
        a = min(self.acceptance, 0.999)
        rates = [(1 - a ** (k + 1)) / (1 - a) / (k * self.t_draft + self.t_verify) for k in range(self.k_max + 1)]
        best = max(rates)
        return max(k for k, rate in enumerate(rates) if rate >= best * (1 - self.tolerance))


@dataclass
class PipelineWidth:
    """How many pipelined branches a sequence drafts per round (draft_service.generation._draft_ahead); one
    instance per draft process, fed by every sequence's rounds.

    Drafting ahead is free only while it ends before the verdict it runs beside: the verdict that arrives first
    waits for it. So each round measures that stall (from the verdict's arrival to its processing): a stall
    above `narrow_share` of the round drops a branch, one below `widen_share` adds one back. At width 0
    pipelining is off for the sequence, and one branch is tried again every `probe_rounds` rounds. The width
    only decides which proposals are sent early, never what is verified: outputs do not depend on it. With
    `learn` False the width stays as set (--pipeline-width).
    """

    max_width: int
    width: int = -1  # -1: start at max_width
    narrow_share: float = 0.2
    widen_share: float = 0.05
    probe_rounds: int = 16
    learn: bool = True
    _off_rounds: int = 0

    def __post_init__(self) -> None:
        if self.width < 0:
            self.width = self.max_width

    def next_width(self) -> int:
        if self.width > 0:
            return self.width
        self._off_rounds += 1
        if self._off_rounds >= self.probe_rounds:
            self._off_rounds = 0
            return 1
        return 0

    def observe(self, width_used: int, stall_s: float, round_s: float) -> None:
        if not self.learn or width_used == 0 or round_s <= 0:
            return
        if stall_s > self.narrow_share * round_s:
            self.width = width_used - 1
        elif stall_s < self.widen_share * round_s:
            self.width = min(self.max_width, width_used + 1)
        else:
            self.width = width_used
