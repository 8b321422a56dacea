"""One sequence on the draft side: its verified tokens and the tokens whose K/V is in the draft's cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling import SamplingParams
from draft_service.draw_acceptance import DrawRecord


@dataclass(eq=False)
class DraftSequence:
    sampling: SamplingParams  # seeded, its wire mode decided
    token_ids: list[int]  # verified tokens: prompt + generated
    # tokens whose K/V is in the draft cache, in order: verified tokens, then the drafts of the last block
    cached_token_ids: list[int] = field(default_factory=list)
    # pipelined drafting: unverified tokens (the block in flight, the guessed bonus) that drafting continues
    # from as if the verifier had confirmed them
    assumed_token_ids: list[int] = field(default_factory=list)
    # a pipelined branch: shares `fork_from`'s cache blocks (copied on write) until it is adopted or released
    fork_from: DraftSequence | None = None
    # the most tokens of q kept for this sequence, when below the draft model's --q-max-support: the verifier's
    # --max-q-support for a q that is sent (it refuses a longer one). Drafting samples from q truncated to it, so
    # what is sent is what was sampled from. None: the draft model's own.
    q_max_support: int | None = None
    # a sparse sequence's record of which of its tree's draws were accepted (draft_service.draw_acceptance)
    draws: DrawRecord = field(default_factory=DrawRecord)
    # the prompt's tokens at the head of token_ids (0: not known): only to say what the draft model's rows fed
    # (DraftModel's on_rows)
    num_prompt_tokens: int = 0

    def branch(self, assumed: list[int]) -> DraftSequence:
        """A branch continuing the verified tokens and then `assumed`, sharing this sequence's cache for the
        longest prefix they have in common. Its verified token list is this sequence's own (not a copy)."""
        return DraftSequence(self.sampling, self.token_ids, self.cached_token_ids[:self._reusable(assumed)],
                             list(assumed), fork_from=self, q_max_support=self.q_max_support,
                             num_prompt_tokens=self.num_prompt_tokens)

    def adopt(self, branch: DraftSequence) -> None:
        """Take over a branch whose assumed tokens the verifier confirmed (the cache blocks move separately)."""
        self.cached_token_ids = branch.cached_token_ids
        self.assumed_token_ids = []

    @property
    def context_ids(self) -> list[int]:
        """What the next draft continues: the verified tokens, then the assumed ones."""
        return self.token_ids + self.assumed_token_ids if self.assumed_token_ids else self.token_ids

    @property
    def num_context(self) -> int:
        return len(self.token_ids) + len(self.assumed_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached(self) -> int:
        return len(self.cached_token_ids)

    @property
    def num_unfed(self) -> int:
        """Context tokens the draft model has not fed, the last one aside (every drafting round feeds that one,
        whose logits it samples): what the next drafting round catches up first unless warmed."""
        return max(0, self.num_context - 1 - self.num_cached)

    def extend(self, verified_token_ids: tuple[int, ...]) -> None:
        self.token_ids.extend(verified_token_ids)

    def roll_back(self) -> None:
        """Keep the cache for the longest prefix the draft fed that matches the context (the verified tokens,
        then any assumed ones): accepted drafts stay, the rejected one and everything after it go, and nothing
        is recomputed. At least the context's last token stays uncached, because feeding it is what gives the
        logits of the next draft."""
        del self.cached_token_ids[self._reusable(self.assumed_token_ids):]

    def _reusable(self, assumed: list[int]) -> int:
        """How many leading cached tokens agree with the verified tokens followed by `assumed`, leaving that
        context's last token uncached."""
        verified, cached = self.token_ids, self.cached_token_ids
        limit = min(len(cached), len(verified) + len(assumed) - 1)
        n = 0
        while n < limit and cached[n] == (verified[n] if n < len(verified) else assumed[n - len(verified)]):
            n += 1
        return n
