"""One sequence on the verifier: its verified tokens, how many of them have K/V in the cache, its queue of
proposals, and where it stands (waiting for blocks, or running)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from common.sampling import SamplingParams
from verifier_service.types import ProposeCmd, SeqKey


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # opened or preempted: holds no KV blocks
    RUNNING = enum.auto()  # admitted: holds KV blocks


@dataclass(eq=False)
class Sequence:
    key: SeqKey
    token_ids: list[int]  # verified: prompt + generated
    num_prompt_tokens: int
    sampling: SamplingParams  # seeded
    # tokens whose K/V is in the cache; always below num_tokens, because each proposal feeds [last, drafts]
    num_cached: int = 0
    proposals: deque[ProposeCmd] = field(default_factory=deque)
    status: SequenceStatus = SequenceStatus.WAITING
    last_active: float = 0.0  # time.monotonic() of its open, last proposal or last verdict
    deadline: float | None = None  # time.monotonic() of the client's deadline
    last_scheduled_step: int = 0  # the scheduler's step count when it last ran (fair turns)
    cache_salt: str | None = None  # its prefix-cache chain: shared only with sequences of the same salt
    follows_choice: bool = False  # its last verified proposal asked for the next draft length (goodput's choice)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_output_left(self) -> int:
        """The tokens the request may still emit (its max_tokens less what it has)."""
        return self.sampling.max_tokens - self.num_generated

    @property
    def needs_prefill(self) -> bool:
        """Tokens before the last are not all cached yet (a new prompt, or a preempted sequence)."""
        return self.num_cached < self.num_tokens - 1

    @property
    def has_work(self) -> bool:
        return bool(self.proposals) or self.needs_prefill
