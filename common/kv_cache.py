"""The paged KV pool tensors: one key and one value tensor per layer, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.key_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer: the tensor side of copy-on-write."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies])
        dst = torch.tensor([c[1] for c in copies])
        for cache in (*self.key_caches, *self.value_caches):
            cache[dst] = cache[src]

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.spec.bytes_per_token


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: int) -> int:
    return budget_bytes // (spec.bytes_per_token * block_size)
