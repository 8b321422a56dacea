"""A sequence's queue of proposals: which the verifier can verify now, which no later verdict can make verifiable
(pipelined branches whose guess missed), and dropping those (each drop is answered with ProposalDropped)."""

from __future__ import annotations

from collections import deque

from verifier_service.sequence import Sequence
from verifier_service.types import DroppedOut, ProposeCmd


def drop_until_verifiable(seq: Sequence) -> list[DroppedOut]:
    """Before a step: drop the proposals that can never be verified (drop_never_verifiable), then those at
    the head of the queue that cannot be verified now. A proposal that starts anywhere but at the sequence's
    end, or assumed other tokens than those verified before it, was drafted from a prefix the verdicts did not
    confirm (a pipelined draft's guess that missed). Only a proposal drafted from the exact verified prefix
    is verified, so outputs do not depend on pipelining."""
    dropped = drop_never_verifiable(seq)
    while seq.proposals and not verifiable_now(seq.proposals[0], seq):
        stale = seq.proposals.popleft()
        dropped.append(DroppedOut(seq.key, stale.start_position, seq.num_tokens))
    return dropped


def drop_never_verifiable(seq: Sequence) -> list[DroppedOut]:
    """Drop, wherever they wait in the queue, the proposals no later verdict can make verifiable (the other
    branches of a pipelined draft), so they do not fill the sequence's queue."""
    dropped: list[DroppedOut] = []
    kept: deque[ProposeCmd] = deque()
    for p in seq.proposals:
        if never_verifiable(p, seq):
            dropped.append(DroppedOut(seq.key, p.start_position, seq.num_tokens))
        else:
            kept.append(p)
    if dropped:
        seq.proposals = kept
    return dropped


def verifiable_now(proposal: ProposeCmd, seq: Sequence) -> bool:
    """It starts at the sequence's end, and the tokens it assumed are the last verified ones."""
    start, assumed = proposal.start_position, proposal.assumed_token_ids
    return start == seq.num_tokens and (not assumed or tuple(seq.token_ids[start - len(assumed):]) == assumed)


def never_verifiable(proposal: ProposeCmd, seq: Sequence) -> bool:
    """It starts before the sequence's end, or assumed a token that differs from one verified since."""
    n = seq.num_tokens
    start, assumed = proposal.start_position, proposal.assumed_token_ids
    if start < n:
        return True
    first = start - len(assumed)
    return any(seq.token_ids[i] != t for i, t in enumerate(assumed[:max(0, n - first)], first))
