"""Sampling parameters of one request, validated once at the edge of each service."""

from __future__ import annotations

import dataclasses
import enum
import secrets
from dataclasses import dataclass

from common.errors import invalid_argument

MAX_SEED = 2**63 - 1
# NOTE: temperatures below this are greedy (vLLM's rule). Dividing logits by a temperature near zero overflows
# them to inf and the softmax to NaN; greedy is what such a temperature means anyway.
GREEDY_TEMPERATURE = 1e-5


class WireMode(enum.Enum):
    """How a sampled request's drafts are verified and what travels with them (greedy requests: argmax)."""

    SPARSE = "sparse"  # rejection sampling against q, sent on its top tokens
    ONE_HOT = "one-hot"  # rejection sampling with q = delta(draft token): ids only
    COUPLED = "coupled"  # Gumbel-max coupling: ids only; the seeded output is the target-alone output


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    # How a sampled request's drafts are verified and what travels with them: the one place the wire mode lives,
    # on both services. None: not decided here (the draft service's --wire-mode; on the verifier, rejection
    # sampling against whatever q each proposal carries). Greedy requests take the argmax whatever it says.
    wire_mode: WireMode | None = None

    def __post_init__(self) -> None:
        validate_sampling(self)

    @property
    def is_greedy(self) -> bool:
        """temperature < GREEDY_TEMPERATURE (0 included) samples the argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_coupled(self) -> bool:
        """Sampled by Gumbel-max coupling: every token is argmax p / E with the noise of its (seed, position), so
        the seeded output is the target-alone output whatever the drafts; its proposals carry token ids only."""
        return self.wire_mode is WireMode.COUPLED and not self.is_greedy

    @property
    def output_ignores_drafts(self) -> bool:
        """Greedy or coupled: each token is the target's alone (its argmax, or argmax p / E with the noise of its
        seed and position), so neither the drafts nor where rounds start ever change the output. Rejection
        sampling decides a drafted position and a bonus one differently: there they do."""
        return self.is_greedy or self.is_coupled

    @property
    def sends_draft_probs(self) -> bool:
        """Sampled with q sent on its top tokens (sparse): the only mode whose proposals carry draft_probs."""
        return self.wire_mode is WireMode.SPARSE and not self.is_greedy

    def with_seed(self) -> SamplingParams:
        """The same parameters with a seed drawn now if none was given: every sequence gets its own stream."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbelow(MAX_SEED))


def validate_sampling(params: SamplingParams) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) with a readable message for out-of-range parameters."""
    t = params.temperature
    if not (t == t) or t < 0 or t == float("inf"):
        raise invalid_argument(f"temperature must be a finite number >= 0 (0 means greedy), got {t}")
    if params.top_k < 0:
        raise invalid_argument(f"top_k must be >= 0 (0 disables it), got {params.top_k}")
    if not (0.0 < params.top_p <= 1.0):
        raise invalid_argument(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_tokens < 1:
        raise invalid_argument(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.seed is not None and not (0 <= params.seed <= MAX_SEED):
        raise invalid_argument(f"seed must be in [0, 2^63 - 1], got {params.seed}")


def validate_token_ids(token_ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    if not token_ids:
        raise invalid_argument(f"{what} is empty: give at least one token")
    bad = [t for t in token_ids if t < 0 or t >= vocab_size]
    if bad:
        raise invalid_argument(f"{what} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class SparseProbs:
    """One draft position's q as it travels: the distribution the draft sampled from, on its support only."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


class FinishReason(enum.StrEnum):
    """A str: equal to its value ("stop" == FinishReason.STOP), which is what the SDK's users compare with."""

    STOP = "stop"  # end-of-sequence token or stop string
    LENGTH = "length"  # max_tokens or the model's context length
    CANCELLED = "cancelled"


def count_positions(counts: list[int], n: int) -> None:
    """Add one to counts[0..n) (per-position drafted / accepted statistics), growing the list as needed."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
