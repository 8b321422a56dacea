"""Typed values inside the draft service (protobuf stays in servicer.py and verifier_link.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ErrorCode
from common.sampling import FinishReason, SamplingParams, SparseProbs
from common.token_tree import tree_depths


@dataclass(frozen=True)
class DraftBlock:
    token_ids: tuple[int, ...]
    draft_probs: tuple[SparseProbs, ...] | None  # q of each draft token; None for greedy and n-gram drafts
    # per position, the draft's most likely tokens other than the drafted one, best first: its guesses of the
    # verifier's corrected token if that draft is rejected (pipelined drafting); None: no guesses (n-gram)
    alternatives: tuple[tuple[int, ...], ...] | None = None
    # the model's time for the batch that drafted it (Proposal.draft_seconds); None: not drafted by a model batch.
    # Not part of what the block is: two equal drafts are equal however long they took.
    draft_seconds: float | None = field(default=None, compare=False)
    # a token tree (draft_service.tree_drafting): each token's parent among them, -1 for the root; None: a chain
    parents: tuple[int, ...] | None = None
    # a tree's best path (indices of its tokens), what the draft's cache holds past the context; None: a chain
    path: tuple[int, ...] | None = None
    # a greedy, one-hot or coupled tree's nodes' ranks among their siblings and the draft's probabilities of them
    # given their parents (what draft_service.tree_calibration learns from); not sent
    node_ranks: tuple[int, ...] | None = field(default=None, compare=False)
    node_probs: tuple[float, ...] | None = field(default=None, compare=False)
    # context the batch that drafted it fed first, beyond a usual round's (Proposal.catch_up_tokens; 0: a usual
    # round): its draft_seconds include feeding it
    catch_up_tokens: int = field(default=0, compare=False)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_positions(self) -> int:
        """The positions its tokens cover: a chain's length, a tree's depth."""
        if self.parents is None:
            return len(self.token_ids)
        return max(tree_depths(self.parents), default=-1) + 1

    @property
    def path_token_ids(self) -> tuple[int, ...]:
        """What acceptance of the whole block means to the draft: a chain's tokens, a tree's best path."""
        if self.path is None:
            return self.token_ids
        return tuple(self.token_ids[i] for i in self.path)


EMPTY_BLOCK = DraftBlock((), None)


@dataclass(frozen=True)
class VerdictEvent:
    start_position: int
    num_accepted: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    batch_size: int
    step_time_s: float = 0.0
    received_at: float = 0.0  # time.perf_counter() when it arrived from the verifier
    next_draft_tokens: int | None = None  # the verifier's choice of the next block's length (goodput)
    step: int = 0  # the verifier's step that gave it; 0: not stated (Verdict.step)
    step_verdicts: int = 0  # that step's verdicts on this stream whose sequences go on (Verdict.step_verdicts)
    plain_from: int | None = None  # the load from which the verifier would decode plainly (Verdict.plain_from)


@dataclass(frozen=True)
class DroppedEvent:
    start_position: int
    num_verified: int


@dataclass(frozen=True)
class ErrorEvent:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class StreamLost:
    """The Verify stream broke: the verifier has forgotten the sequence, which must be resumed on a new one."""

    reason: str


LinkEvent = VerdictEvent | DroppedEvent | ErrorEvent | StreamLost


@dataclass(frozen=True)
class VerifierIdentity:
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_draft_tokens: int
    max_model_len: int
    features: tuple[str, ...] = ()  # VerifierInfo.features
    # what decides the output besides the tokens; "" from a verifier older than these fields
    model_fingerprint: str = ""
    dtype: str = ""
    quantization: str = ""
    # VerifierInfo.max_q_support: entries one draft distribution may list; 0 from an older verifier (unknown,
    # taken as unlimited)
    max_q_support: int = 0
    max_tree_nodes: int = 0  # VerifierInfo.max_tree_nodes: 0 from a verifier that takes chains only

    def takes_trees(self, num_nodes: int) -> bool:
        """Whether this verifier verifies token trees of `num_nodes` nodes."""
        return self.max_tree_nodes >= num_nodes > 0

    def target_change(self, now: VerifierIdentity) -> str | None:
        """Why a sequence started on this verifier's target cannot continue on `now`'s, or None. Compared: the
        model fingerprint (the model id when either side has none: an older verifier), the dtype and the
        quantization (each when both sides state it)."""
        changed = []
        if self.model_fingerprint and now.model_fingerprint:
            if self.model_fingerprint != now.model_fingerprint:
                changed.append(f"model fingerprint {self.model_fingerprint[:16]} ({self.model_id!r}) -> "
                               f"{now.model_fingerprint[:16]} ({now.model_id!r})")
        elif self.model_id != now.model_id:
            changed.append(f"model {self.model_id!r} -> {now.model_id!r}")
        if self.dtype and now.dtype and self.dtype != now.dtype:
            changed.append(f"dtype {self.dtype} -> {now.dtype}")
        if self.quantization and now.quantization and self.quantization != now.quantization:
            changed.append(f"quantization {self.quantization} -> {now.quantization}")
        if not changed:
            return None
        return (f"the verifier's target changed since this sequence started ({'; '.join(changed)}): continuing "
                "it there would mix two models' output, so it is not resumed; retry the request")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None
    deadline: float | None = None  # time.monotonic() of the client's deadline; None: none
    cache_salt: str | None = None  # the verifier shares cached prefix blocks only within one salt
    fixed_k: bool = False  # the request asked for its k every round (needs --allow-request-fixed)


@dataclass(frozen=True)
class TextChunk:
    token_ids: tuple[int, ...]
    text: str
