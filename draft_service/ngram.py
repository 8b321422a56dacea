"""Prompt-lookup drafting: no model. The longest recent n-gram that ends the sequence is looked up earlier in
the sequence (prompt and generated text) and the tokens that followed it are proposed. Strong on code edits,
retrieval-heavy prompts and anything that repeats its input; proposals are one-hot (q = delta), so sampling
stays lossless."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, *, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    if k <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # most recent earlier occurrence: scan backwards, excluding the suffix itself
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []
