"""One generation's statistics: the one definition the draft service fills, the Generate stream carries (as
draft.proto's Stats, mapped in specwire/v1/wire.py) and the SDK returns. Torch-free, so the SDK imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling import FinishReason, count_positions


@dataclass
class GenerationStats:
    # NOTE: the fields are draft.proto's Stats fields, by name and in its order (wire.stats_to_proto maps them
    # by name; tests/test_wire.py checks that both lists agree).
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    draft_time_s: float = 0.0
    verify_wait_s: float = 0.0
    num_speculative_tokens: int = 0
    verify_time_s: float = 0.0
    num_rejected_rounds: int = 0
    proposal_bytes: int = 0  # serialized size of the proposals the draft service sent for this request

    def record_round(self, *, num_draft_tokens: int, num_accepted: int, num_emitted: int, draft_s: float,
                     wait_s: float, verify_s: float, num_positions: int | None = None) -> None:
        """One draft -> verify round: what was drafted, what the verifier kept, what reached the client (fewer
        tokens than the verdict's when a stop string ended the generation), and where the time went.
        num_positions: the positions the drafts covered (a token tree's depth); default num_draft_tokens."""
        self.num_rounds += 1
        self.draft_time_s += draft_s
        self.verify_wait_s += wait_s
        self.verify_time_s += verify_s
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        positions = num_draft_tokens if num_positions is None else num_positions
        self.num_rejected_rounds += num_accepted < positions
        count_positions(self.drafted_per_position, positions)
        count_positions(self.accepted_per_position, num_accepted)
        self.num_generated_tokens += num_emitted

    @property
    def network_time_s(self) -> float:
        """Waiting on the verifier minus its compute: network, queueing, (de)serialisation."""
        return max(0.0, self.verify_wait_s - self.verify_time_s)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round (1 + accepted drafts per round)."""
        return self.num_generated_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position,
                                                    strict=False)]
