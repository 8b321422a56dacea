"""Checks of what drafts send, before anything reaches the scheduler: each failure is a ServiceError whose
message tells the draft's author what to fix."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError, invalid_argument
from common.sampling import SamplingParams, SparseProbs, validate_token_ids
from verifier_service.types import OpenCmd, ProposeCmd

# A proposal's q must sum to 1 within this (float32 on the wire).
Q_SUM_TOLERANCE = 1e-3
# Children of one token-tree node: a row's rejections cost a pass over the vocabulary per earlier child each
# (kernels.rejection_sampler), so a draft cannot make one row cost more than 16 * 17 / 2 of them.
MAX_TREE_BRANCHES = 16


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_draft_tokens: int
    max_q_support: int = 256  # entries of one draft distribution (--max-q-support)
    max_tree_nodes: int = 0  # draft tokens of one token-tree proposal (--max-tree-nodes); 0: chains only
    max_tree_depth: int | None = None  # positions a tree may span, when below max_draft_tokens (a sliding window)


def check_prompt_length(num_tokens: int, limits: Limits) -> None:
    """First, and on the wire message's count: a prompt past the context costs nothing to refuse."""
    if num_tokens >= limits.max_model_len:
        raise invalid_argument(f"prompt has {num_tokens} tokens; the target's context length is "
                               f"{limits.max_model_len} and one token must remain to generate")


def check_open(cmd: OpenCmd, limits: Limits, blocks: BlockManager) -> None:
    """The checks from the counts first; the prompt's token ids, O(n), last."""
    num_tokens = len(cmd.prompt_token_ids)
    check_prompt_length(num_tokens, limits)
    if not num_tokens:
        raise invalid_argument("prompt is empty: give at least one token")
    if not 0 <= cmd.num_output_tokens < num_tokens:
        raise invalid_argument(f"num_output_tokens {cmd.num_output_tokens} must be below the {num_tokens} tokens "
                               "sent (a resumed sequence keeps at least one prompt token)")
    if cmd.num_output_tokens >= cmd.sampling.max_tokens:
        raise invalid_argument(f"the resumed sequence already has {cmd.num_output_tokens} output tokens, "
                               f"max_tokens is {cmd.sampling.max_tokens}: it has finished")
    needed = blocks.blocks_for(num_tokens + limits.max_draft_tokens + 1)
    if needed > blocks.num_blocks:
        raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"prompt of {num_tokens} tokens plus a draft block "
                           f"needs {needed} KV blocks; the verifier's pool has {blocks.num_blocks} (raise "
                           "--kv-cache-memory or --num-blocks)")
    validate_token_ids(list(cmd.prompt_token_ids), limits.vocab_size)


def check_proposal_size(num_draft_tokens: int, num_assumed: int, q_sizes: list[int], limits: Limits,
                        num_parents: int = 0) -> None:
    """What a proposal costs to check and pack, from its counts alone: run on the wire message before it is
    converted, so that a proposal listing the whole vocabulary at every position costs nothing to refuse."""
    if num_parents:
        if not limits.max_tree_nodes:
            raise invalid_argument("proposal is a token tree (draft_parents set); this verifier takes chains only "
                                   "(GetInfo.max_tree_nodes is 0): send draft tokens without parents")
        if num_parents != num_draft_tokens:
            raise invalid_argument(f"proposal has {num_draft_tokens} draft tokens but {num_parents} draft_parents")
        if num_draft_tokens > limits.max_tree_nodes:
            raise invalid_argument(f"token tree has {num_draft_tokens} nodes; this verifier accepts at most "
                                   f"{limits.max_tree_nodes} (GetInfo.max_tree_nodes)")
    elif num_draft_tokens > limits.max_draft_tokens:
        raise invalid_argument(f"proposal has {num_draft_tokens} draft tokens; this verifier accepts at most "
                               f"{limits.max_draft_tokens} (GetInfo.max_draft_tokens)")
    if num_assumed > limits.max_draft_tokens + 1:
        raise invalid_argument(f"{num_assumed} assumed tokens: at most the verdict in flight's "
                               f"{limits.max_draft_tokens + 1}")
    if len(q_sizes) > num_draft_tokens:
        raise invalid_argument(f"proposal has {num_draft_tokens} draft tokens but {len(q_sizes)} draft "
                               "distributions")
    largest = max(q_sizes, default=0)
    if largest > limits.max_q_support:
        raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"a draft distribution lists {largest} tokens; this "
                           f"verifier accepts at most {limits.max_q_support} per position (--max-q-support): "
                           "truncate q to its most probable tokens (the draft's --q-max-support) and renormalise")


def check_proposal_on(cmd: ProposeCmd, sampling: SamplingParams) -> None:
    """The part of the checks that needs the sequence's sampling parameters: a coupled sequence's proposals carry
    token ids only. O(1): this runs on the engine thread."""
    if sampling.is_coupled and cmd.draft_probs is not None:
        raise invalid_argument("the sequence was opened coupled: its proposals carry token ids only, no "
                               "draft_probs (the verifier decides every token from its own noise)")


def check_proposal(cmd: ProposeCmd, limits: Limits, sampling: SamplingParams | None = None) -> None:
    """Everything but the sequence's state, and with its `sampling` check_proposal_on too. Its cost is bounded
    by check_proposal_size, which it runs first."""
    k = cmd.num_draft_tokens
    check_proposal_size(k, len(cmd.assumed_token_ids),
                        [max(len(q.token_ids), len(q.probs)) for q in cmd.draft_probs or ()], limits,
                        num_parents=len(cmd.draft_parents or ()))
    if sampling is not None:
        check_proposal_on(cmd, sampling)
    if cmd.draft_seconds is not None and not 0.0 <= cmd.draft_seconds < math.inf:
        raise invalid_argument(f"draft_seconds must be a finite time >= 0, got {cmd.draft_seconds}")
    if cmd.assumed_token_ids:
        if len(cmd.assumed_token_ids) > min(cmd.start_position, limits.max_draft_tokens + 1):
            raise invalid_argument(f"{len(cmd.assumed_token_ids)} assumed tokens: at most the verdict in flight's "
                                   f"{limits.max_draft_tokens + 1}, and no more than start_position "
                                   f"{cmd.start_position}")
        validate_token_ids(list(cmd.assumed_token_ids), limits.vocab_size, what="assumed")
    if k:
        validate_token_ids(list(cmd.draft_token_ids), limits.vocab_size, what="draft")
    if cmd.draft_parents is not None:
        _check_tree(cmd, limits)
    if cmd.draft_probs is None:
        return
    if len(cmd.draft_probs) != k:
        raise invalid_argument(f"proposal has {k} draft tokens but {len(cmd.draft_probs)} draft distributions")
    for j, (x, q) in enumerate(zip(cmd.draft_token_ids, cmd.draft_probs, strict=True)):
        _check_draft_probs(f"draft distribution {j}", x, q, limits.vocab_size)


def _check_tree(cmd: ProposeCmd, limits: Limits) -> None:
    """Parents come before their children, and the tree is no deeper than the verifier takes."""
    children: dict[int, int] = {}
    for i, parent in enumerate(cmd.draft_parents):
        if not -1 <= parent < i:
            raise invalid_argument(f"draft_parents[{i}] is {parent}: a draft token's parent is -1 (the last verified "
                                   "token) or an earlier draft token")
        children[parent] = children.get(parent, 0) + 1
        if children[parent] > MAX_TREE_BRANCHES:
            raise invalid_argument(f"token tree node {parent} has more than {MAX_TREE_BRANCHES} children; this "
                                   f"verifier takes at most {MAX_TREE_BRANCHES} per node")
    depth = cmd.num_positions
    if depth > limits.max_draft_tokens:
        raise invalid_argument(f"token tree is {depth} tokens deep; this verifier accepts at most "
                               f"{limits.max_draft_tokens} (GetInfo.max_draft_tokens)")
    if limits.max_tree_depth is not None and depth > limits.max_tree_depth:
        raise invalid_argument(f"token tree is {depth} tokens deep; this target's sliding window takes trees of at "
                               f"most {limits.max_tree_depth}")


def _check_draft_probs(where: str, x: int, q: SparseProbs, vocab_size: int) -> None:
    """q must be a distribution the draft could have sampled x from."""
    if len(q.token_ids) != len(q.probs) or not q.token_ids:
        raise invalid_argument(f"{where}: token_ids and probs must be non-empty and of equal length")
    if len(set(q.token_ids)) != len(q.token_ids):
        raise invalid_argument(f"{where}: repeated token ids")
    validate_token_ids(list(q.token_ids), vocab_size, what=where)
    if any(not (p >= 0.0) or math.isinf(p) for p in q.probs):
        raise invalid_argument(f"{where}: probabilities must be finite and >= 0")
    total = sum(q.probs)
    if abs(total - 1.0) > Q_SUM_TOLERANCE:
        raise invalid_argument(f"{where}: probabilities sum to {total:.6f}, not 1")
    q_x = q.probs[q.token_ids.index(x)] if x in q.token_ids else 0.0
    if q_x <= 0.0:
        raise invalid_argument(f"{where}: the drafted token {x} has probability 0 under it, so it cannot be the "
                               "distribution the draft sampled from")
