"""Paged KV-cache bookkeeping in plain Python: a pool of fixed-size blocks and one block table per sequence.

No torch here: the tensors live in common/kv_cache.py and this module only decides which slots a sequence's
tokens occupy. Invariant: every block is either free or in exactly one table, so
num_free_blocks + num_used_blocks == num_blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq: Hashable) -> list[int]:
        return self._tables.setdefault(seq, [])

    def has(self, seq: Hashable) -> bool:
        return seq in self._tables

    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def can_allocate(self, seq: Hashable, num_tokens: int) -> bool:
        held = len(self._tables.get(seq, ()))
        return self.blocks_for(num_tokens) - held <= len(self._free)

    def allocate(self, seq: Hashable, num_tokens: int) -> bool:
        """Grow `seq`'s table to hold `num_tokens` tokens. False (and nothing changed) when blocks are short."""
        if not self.can_allocate(seq, num_tokens):
            return False
        table = self.table(seq)
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            table.append(self._free.popleft())
        return True

    def truncate(self, seq: Hashable, num_tokens: int) -> None:
        """Shrink `seq` to its first `num_tokens` tokens (rollback after a verdict); freed blocks are reused."""
        table = self._tables.get(seq)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq: Hashable) -> None:
        table = self._tables.pop(seq, None)
        if table:
            self._free.extend(reversed(table))

    def slots(self, seq: Hashable, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end) of `seq` (its table must already cover them)."""
        table, bs = self._tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
