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
        best_k, best = 0, 0.0
        for k in range(self.k_max + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / (k * self.t_draft + self.t_verify)
            if rate > best:
                best_k, best = k, rate
        return best_k
