"""Token trees as the wire carries them: each draft token's parent among the block's tokens (-1 for the last
verified token), parents before their children. Depths and ancestor masks, for the verifier's checks and batch
and for the draft's own tree."""

from __future__ import annotations

from collections.abc import Iterable


def tree_depths(parents: Iterable[int]) -> list[int]:
    """Each token's depth: its position less the block's first (0 for a child of the verified tokens)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def ancestor_masks(parents: Iterable[int]) -> list[int]:
    """Per token, the bits of itself and its ancestors (bit j: token j), as int64 values (bit 63 is the sign):
    what tree attention reads (kernels.paged_attention)."""
    masks: list[int] = []
    for i, parent in enumerate(parents):
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]
