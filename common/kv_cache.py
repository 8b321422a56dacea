"""The paged KV pool tensors: one key and one value tensor per layer, sized from a memory budget. Layers may
differ in KV heads and head dims, and a layer's values may have another head dim than its keys (MLA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    """One layer's cached K and V per token: num_kv_heads x head_dim keys, num_kv_heads x v_head_dim values."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # of every layer, unless `layers` says otherwise
    head_dim: int
    dtype: torch.dtype
    layers: tuple[LayerShape, ...] | None = None  # per layer, when they differ from the above; None: uniform

    @classmethod
    def from_layers(cls, layers: list[LayerShape], dtype: torch.dtype) -> KVCacheSpec:
        first = layers[0]
        uniform = all(s == first for s in layers) and first.v_head_dim == first.head_dim
        return cls(len(layers), first.num_kv_heads, first.head_dim, dtype, None if uniform else tuple(layers))

    def layer(self, i: int) -> LayerShape:
        if self.layers is not None:
            return self.layers[i]
        return LayerShape(self.num_kv_heads, self.head_dim, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return size * sum(s.num_kv_heads * (s.head_dim + s.v_head_dim)
                          for s in (self.layer(i) for i in range(self.num_layers)))


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        for i in range(spec.num_layers):
            s = spec.layer(i)
            self.key_caches.append(torch.zeros((num_blocks, block_size, s.num_kv_heads, s.head_dim),
                                               dtype=spec.dtype, device=device))
            self.value_caches.append(torch.zeros((num_blocks, block_size, s.num_kv_heads, s.v_head_dim),
                                                 dtype=spec.dtype, device=device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer: the tensor side of copy-on-write."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies])
        dst = torch.tensor([c[1] for c in copies])
        for cache in (*self.key_caches, *self.value_caches):
            cache[dst] = cache[src]

    def copy_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy single tokens' K and V (source slot, destination slot) in every layer; every source is read before
        any destination is written."""
        device = self.key_caches[0].device
        src, dst = torch.tensor(moves, dtype=torch.int64).t().to(device)  # one copy to the device
        for cache in (*self.key_caches, *self.value_caches):
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst] = flat[src]

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.spec.bytes_per_token


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: int) -> int:
    return budget_bytes // (spec.bytes_per_token * block_size)
