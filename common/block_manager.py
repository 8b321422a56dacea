"""Paged KV-cache bookkeeping in plain Python (no torch): a pool of fixed-size blocks, one block table per
sequence, reference counts, prefix caching and copy-on-write. The tensors live in common/kv_cache.py.

Prefix caching: a block whose tokens are all *verified* (never drafts) and complete is registered under a
chained hash, sha256(parent block's hash, its token ids), so a hit means the whole prefix matches. Every hit is
re-checked against the stored token ids and the stored parent hash, so even a collision never serves the K/V of
another prefix (vLLM moved from Python's hash() to sha256 for the same reason). A freed block keeps its hash
until it is handed out again: the free list doubles as an LRU prefix cache.

A cache salt (vLLM's per-request cache_salt) is the parent of a sequence's first block: its chain starts from
sha256(salt) instead of the shared root, so a salted sequence shares blocks only with sequences of the same
salt, and unsalted ones only with unsalted ones. Every later block inherits the salt through the chain.

Invariants (tests/test_block_manager.py checks them under random operation sequences):
- num_free_blocks + num_used_blocks == num_blocks; a block is free iff its reference count is 0;
- a block's reference count equals the number of tables that hold it; a block in two tables is a complete,
  registered block, which nobody writes (writes go through copy_on_write first);
- every registered hash maps to a block whose stored token ids are the ones hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    parent_hash: bytes | None = None  # the chain link, checked on every hit
    token_ids: tuple[int, ...] = ()  # set when registered


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its leading registered blocks
    root: bytes | None = None  # the parent of its first block: salt_root(its cache salt)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order: oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self.num_prefix_hit_tokens = 0

    # -- sizes ------------------------------------------------------------------------------------------------

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

    # -- tables -----------------------------------------------------------------------------------------------

    def table(self, seq: Hashable) -> list[int]:
        return self._seq(seq).table

    def has(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def sequences(self) -> list[Hashable]:
        return list(self._seqs)

    def _seq(self, seq: Hashable) -> _SeqBlocks:
        return self._seqs.setdefault(seq, _SeqBlocks())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the least recently freed cached block
            self._unregister(block)
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self._free[block_id] = None

    def can_allocate(self, seq: Hashable, num_tokens: int) -> bool:
        held = len(self._seqs[seq].table) if seq in self._seqs else 0
        return self.blocks_for(num_tokens) - held <= len(self._free)

    def allocate(self, seq: Hashable, num_tokens: int) -> bool:
        """Grow `seq`'s table to hold `num_tokens` tokens. False (and nothing changed) when blocks are short."""
        if not self.can_allocate(seq, num_tokens):
            return False
        table = self._seq(seq).table
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            table.append(self._take_free())
        return True

    def truncate(self, seq: Hashable, num_tokens: int) -> None:
        """Shrink `seq` to its first `num_tokens` tokens (rollback after a verdict); freed blocks are reused."""
        s = self._seqs.get(seq)
        if s is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(s.table) > keep:
            self._release(s.table.pop())
        del s.hashes[num_tokens // self.block_size:]

    def _unregister(self, block: Block) -> None:
        if self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()

    def free(self, seq: Hashable) -> None:
        s = self._seqs.pop(seq, None)
        if s is not None:
            # NOTE: release the tail first so the LRU evicts a sequence's last blocks before its shared prefix.
            for block_id in reversed(s.table):
                self._release(block_id)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """`new` takes over `old`'s blocks (a pipelined draft branch becoming the sequence); `new` must hold none."""
        if new in self._seqs and self._seqs[new].table:
            raise ValueError(f"rename target {new!r} already holds blocks")
        self._seqs[new] = self._seqs.pop(old)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """`child` shares every block of `parent` (read-only until copy_on_write)."""
        if child in self._seqs and self._seqs[child].table:
            raise ValueError(f"fork target {child!r} already holds blocks")
        p = self._seqs[parent]
        for block_id in p.table:
            self.blocks[block_id].ref_count += 1
        self._seqs[child] = _SeqBlocks(list(p.table), list(p.hashes), p.root)

    def copy_on_write(self, seq: Hashable, start: int, end: int) -> list[tuple[int, int]] | None:
        """Make the blocks covering positions [start, end) exclusively `seq`'s before it writes there: a
        shared block is copied, and a registered block that only `seq` holds leaves the prefix cache (after a
        rollback below it, what `seq` writes there is not what the hash promises).
        Returns the (source, destination) block copies the caller must apply to the KV tensors, or None when
        blocks are short (nothing changed)."""
        s = self._seqs[seq]
        first, last = start // self.block_size, min(self.blocks_for(end), len(s.table))
        shared = [i for i in range(first, last) if self.blocks[s.table[i]].ref_count > 1]
        if len(shared) > len(self._free):
            return None
        copies = []
        for i in shared:
            src = s.table[i]
            dst = self._take_free()
            self._release(src)
            s.table[i] = dst
            copies.append((src, dst))
        for i in range(first, last):
            block = self.blocks[s.table[i]]
            if block.hash is not None:
                self._unregister(block)
        del s.hashes[first:]
        return copies

    def reserve(self, seq: Hashable, start: int, end: int) -> list[tuple[int, int]] | None:
        """Make positions [start, end) of `seq` writable before a step feeds them: copy_on_write of the blocks
        already there, then allocate up to `end`, all or nothing. Returns the block copies to apply, or None
        when the pool cannot hold both (nothing changed). Done in two calls, a copy-on-write that succeeds
        followed by an allocation that fails would leave the table pointing at copies nobody applies."""
        table = self._seqs[seq].table if seq in self._seqs else []
        first, last = start // self.block_size, min(self.blocks_for(end), len(table))
        num_shared = sum(1 for i in range(first, last) if self.blocks[table[i]].ref_count > 1)
        num_new = max(0, self.blocks_for(end) - len(table))
        if num_shared + num_new > len(self._free):
            return None
        # each copy takes one free block and frees none (its source stays held by another table), so the growth
        # still has the blocks counted for it
        copies = self.copy_on_write(seq, start, end) if table else []
        if copies is None or not self.allocate(seq, end):
            raise RuntimeError(f"reserve({seq!r}, {start}, {end}) miscounted the free blocks")
        return copies

    def slots(self, seq: Hashable, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end) of `seq` (its table must already cover them)."""
        table, bs = self._seqs[seq].table, self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # -- prefix caching ---------------------------------------------------------------------------------------

    @staticmethod
    def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        h = hashlib.sha256(parent or b"root")
        h.update(array("q", token_ids).tobytes())
        return h.digest()

    @staticmethod
    def salt_root(cache_salt: str | None) -> bytes | None:
        """The parent hash of a sequence's first block: None (the shared root) without a salt."""
        if cache_salt is None:
            return None
        return hashlib.sha256(b"specwire-cache-salt\0" + cache_salt.encode()).digest()

    def cached_prefix(self, token_ids: Sequence[int], max_tokens: int, *, cache_salt: str | None = None) -> list[int]:
        """The registered blocks that hold the longest prefix of `token_ids` made of complete blocks within its
        first `max_tokens` tokens, in `cache_salt`'s chain. A lookup: nothing changes."""
        bs, parent, found = self.block_size, self.salt_root(cache_salt), []
        for i in range(min(len(token_ids), max_tokens) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, chunk)
            block_id = self._cached.get(h)
            block = self.blocks[block_id] if block_id is not None else None
            if block is None or block.token_ids != chunk or block.parent_hash != parent:  # miss, or a collision
                break
            found.append(block_id)
            parent = h
        return found

    def can_admit(self, token_ids: Sequence[int], max_prefix_tokens: int, num_tokens: int, *,
                  cache_salt: str | None = None) -> bool:
        """Whether a new sequence whose first tokens are `token_ids` can hold `num_tokens` tokens, counting the
        cached prefix match_prefix would attach (cached blocks on the free list stop being free when attached)."""
        hits = self.cached_prefix(token_ids, max_prefix_tokens, cache_salt=cache_salt)
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(hits) <= len(self._free) - free_hits

    def match_prefix(self, seq: Hashable, token_ids: Sequence[int], max_tokens: int, *,
                     cache_salt: str | None = None) -> int:
        """Attach to a new sequence the blocks of cached_prefix(token_ids, max_tokens, cache_salt=...), and
        make `cache_salt` the root of the blocks it registers from now on. Returns how many tokens they hold."""
        s = self._seq(seq)
        if s.table:
            raise ValueError(f"match_prefix on {seq!r}, which already holds blocks")
        s.root = self.salt_root(cache_salt)
        for block_id in self.cached_prefix(token_ids, max_tokens, cache_salt=cache_salt):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            s.table.append(block_id)
            s.hashes.append(block.hash)
        matched = len(s.table) * self.block_size
        self.num_prefix_hit_tokens += matched
        return matched

    def commit(self, seq: Hashable, token_ids: Sequence[int], num_verified: int) -> None:
        """Register the complete blocks among `seq`'s first `num_verified` tokens, which must be verified tokens
        whose K/V is written (drafts are never registered)."""
        s = self._seqs.get(seq)
        if s is None:
            return
        bs = self.block_size
        for i in range(len(s.hashes), min(num_verified // bs, len(s.table))):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = s.hashes[-1] if s.hashes else s.root
            h = self.chain_hash(parent, chunk)
            s.hashes.append(h)
            block = self.blocks[s.table[i]]
            if block.hash is None and h not in self._cached:
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                self._cached[h] = block.block_id

    def cached_blocks(self) -> dict[int, int]:
        return dict(self._cached)
