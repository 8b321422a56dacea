"""Property tests of the block manager: random allocate / commit / rollback / fork / copy-on-write / free /
prefix-match sequences keep every invariant of common/block_manager.py."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.block_manager import BlockManager

BS, POOL = 4, 24
# few distinct token values so prefixes repeat and the cache gets hits
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=30)
SALTS = st.sampled_from([None, "tenant-a", "tenant-b"])


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(POOL, BS)
        self.tokens: dict[int, list[int]] = {}  # verified tokens of each live sequence
        self.verified: dict[int, int] = {}  # tokens whose K/V is committed
        self.written: dict[int, int] = {}  # tokens whose K/V was ever written (a rollback does not unwrite)
        self.salts: dict[int, str | None] = {}  # each sequence's cache salt
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(tokens=TOKENS, extra=st.integers(0, 40), salt=SALTS)
    def open_with_prefix_match(self, tokens, extra, salt):
        seq = self._new_id()
        # admission is decided before attaching: it must agree with attaching and then asking
        free_before = list(self.bm._free)
        admit = self.bm.can_admit(tokens, len(tokens) - 1, len(tokens) + extra, cache_salt=salt)
        assert list(self.bm._free) == free_before  # the check changed nothing, not even the LRU order
        matched = self.bm.match_prefix(seq, tokens, len(tokens) - 1, cache_salt=salt)
        self.salts[seq] = salt
        assert admit == self.bm.can_allocate(seq, len(tokens) + extra)
        assert matched % BS == 0 and matched <= len(tokens) - 1
        for i in range(matched // BS):  # hits hold exactly the tokens asked for
            assert self.bm.blocks[self.bm.table(seq)[i]].token_ids == tuple(tokens[i * BS:(i + 1) * BS])
        self.tokens[seq] = tokens
        self.verified[seq] = matched
        self.written[seq] = matched

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_drafts=st.integers(0, 6))
    def verify_round(self, data, num_drafts):
        """Write K/V for the unverified tokens plus drafts, accept some, roll back, commit the verified part."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq]
        end = len(tokens) + num_drafts
        copies = self.bm.copy_on_write(seq, self.verified[seq], end)
        if copies is None or not self.bm.allocate(seq, end):
            return
        for src, dst in copies:
            assert src != dst and self.bm.blocks[dst].ref_count == 1
        for b in self._blocks_touched(seq, self.verified[seq], end):  # nobody else may see our writes
            assert self.bm.blocks[b].ref_count == 1 and self.bm.blocks[b].hash is None
        accepted = data.draw(st.integers(0, num_drafts))
        new_tokens = tokens + data.draw(st.lists(st.integers(0, 2), min_size=accepted + 1, max_size=accepted + 1))
        self.verified[seq] = len(tokens) + accepted
        self.written[seq] = max(self.written[seq], self.verified[seq])
        self.bm.truncate(seq, self.verified[seq])
        self.bm.commit(seq, new_tokens, self.verified[seq])
        self.tokens[seq] = new_tokens

    def _blocks_touched(self, seq, start, end):
        table = self.bm.table(seq)
        return {table[p // BS] for p in range(start, end)}

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rollback(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        keep = data.draw(st.integers(0, self.verified[seq]))
        self.bm.truncate(seq, keep)
        self.verified[seq] = keep

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.truncate(parent, self.verified[parent])
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.verified[child] = self.verified[parent]
        self.written[child] = self.written[parent]
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq], self.verified[seq], self.written[seq], self.salts[seq]

    @invariant()
    def pool_is_whole(self):
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == POOL

    @invariant()
    def ref_counts_match_tables(self):
        held = Counter(b for seq in self.bm.sequences() for b in self.bm.table(seq))
        for block in self.bm.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.bm._free)

    @invariant()
    def shared_blocks_hold_verified_tokens_only(self):
        """A block in two tables starts inside every holder's verified tokens (a fork may share a partial last
        block; verify_round checks that no write reaches a shared block before copy_on_write)."""
        for seq in self.bm.sequences():
            for i, b in enumerate(self.bm.table(seq)):
                if self.bm.blocks[b].ref_count > 1:
                    assert i * BS < self.verified[seq], "a shared block holds none of its holder's verified tokens"

    @invariant()
    def cached_hashes_match_tokens(self):
        for h, b in self.bm.cached_blocks().items():
            block = self.bm.blocks[b]
            assert block.hash == h and len(block.token_ids) == BS
        for seq in self.bm.sequences():
            parent = BlockManager.salt_root(self.salts[seq])  # every chain starts from its sequence's salt
            for i, b in enumerate(self.bm.table(seq)):
                block = self.bm.blocks[b]
                chunk = tuple(self.tokens[seq][i * BS:(i + 1) * BS])
                if block.hash is not None:
                    # registered hashes cover only tokens whose K/V was written as verified tokens
                    assert (i + 1) * BS <= self.written[seq], "a registered block holds unwritten tokens"
                    assert block.token_ids == chunk and block.parent_hash == parent
                parent = BlockManager.chain_hash(parent, chunk) if len(chunk) == BS else None


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_prefix_hit_survives_free_until_evicted():
    bm = BlockManager(4, 2)
    assert bm.allocate("a", 5)
    bm.commit("a", [1, 2, 3, 4, 5], 4)
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.match_prefix("b", [1, 2, 3, 4, 9], 4) == 4  # both blocks came back from the free list
    bm.free("b")
    assert bm.allocate("c", 8)  # takes every block: the cached ones are evicted
    bm.free("c")
    assert bm.match_prefix("d", [1, 2, 3, 4, 9], 4) == 0


def test_hash_collision_is_rejected_by_token_check(monkeypatch):
    bm = BlockManager(4, 2)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, tokens: b"7"))  # everything collides
    assert bm.allocate("a", 3)
    bm.commit("a", [1, 2, 3], 2)
    assert bm.match_prefix("b", [5, 6, 7], 2) == 0
    assert bm.match_prefix("c", [1, 2, 7], 2) == 2


def test_can_admit_counts_cached_free_blocks_as_used_once_attached():
    bm = BlockManager(4, 2)
    assert bm.allocate("a", 5)  # 3 blocks
    bm.commit("a", [1, 2, 3, 4, 5], 4)  # blocks 0 and 1 registered
    bm.free("a")  # all free again, two of them cached
    tokens = [1, 2, 3, 4, 9]
    # the 2 cached blocks are reused; the other 2 free blocks give room for 8 tokens, not 10
    assert bm.can_admit(tokens, 4, 8) and not bm.can_admit(tokens, 4, 10)
    assert bm.match_prefix("b", tokens, 4) == 4
    assert bm.can_allocate("b", 8) and not bm.can_allocate("b", 10)


def test_a_collision_with_matching_tokens_but_another_parent_is_rejected(monkeypatch):
    """The chain is compared on a hit, not only the block's own tokens: with every hash colliding, [1, 2, 1, 2]
    must not reuse the block of [1, 2] as its second block."""
    bm = BlockManager(4, 2)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, tokens: b"collide"))
    assert bm.allocate("a", 3)
    bm.commit("a", [1, 2, 9], 2)
    assert bm.match_prefix("b", [1, 2, 1, 2, 5], 4) == 2


def test_chain_hashes_are_sha256_of_parent_and_tokens():
    first = BlockManager.chain_hash(None, [1, 2])
    assert len(first) == 32 and first != BlockManager.chain_hash(None, [2, 1])
    assert BlockManager.chain_hash(first, [3, 4]) != BlockManager.chain_hash(None, [3, 4])


def test_cache_salts_partition_the_prefix_cache():
    """vLLM's cache_salt: the salt is the parent of the first block, so the whole chain differs. Same salt
    shares, another salt shares nothing, and no salt shares only with no salt."""
    bm = BlockManager(32, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]

    def run(seq, salt):
        matched = bm.match_prefix(seq, prompt, len(prompt) - 1, cache_salt=salt)
        assert bm.allocate(seq, len(prompt))
        bm.commit(seq, prompt, len(prompt) - 1)
        return matched

    assert run("a1", "tenant-a") == 0
    assert run("a2", "tenant-a") == 6  # same salt: every complete verified block is shared
    assert run("b1", "tenant-b") == 0  # another salt: nothing
    assert run("n1", None) == 0  # no salt does not see salted blocks...
    assert run("n2", None) == 6
    assert run("c1", "tenant-c") == 0  # ...and a salt does not see unsalted ones
    tables = {seq: set(bm.table(seq)) for seq in ("a1", "a2", "b1", "n1", "n2", "c1")}
    assert tables["a1"] & tables["a2"] and tables["n1"] & tables["n2"]
    for x, y in (("a1", "b1"), ("a1", "n1"), ("b1", "n1"), ("c1", "n1"), ("c1", "a1")):
        assert not tables[x] & tables[y], f"{x} and {y} share a block"
    # the salt follows the chain into every later block, and a salted lookup is only a lookup
    assert bm.cached_prefix(prompt, 6, cache_salt="tenant-a") == bm.table("a1")[:3]
    assert bm.cached_prefix(prompt, 6, cache_salt="tenant-z") == []
    assert not bm.can_admit(prompt, 6, 2 * (bm.num_free_blocks + 1), cache_salt="tenant-z")
    assert bm.can_admit(prompt, 6, 2 * (bm.num_free_blocks + 3), cache_salt="tenant-a")


def test_reserve_copies_and_grows_all_or_nothing():
    """Room for a copy-on-write copy but not also for the growth: reserve changes nothing (a copy_on_write that
    succeeds, then an allocate that fails, would leave the table pointing at a copy nobody applies); with one
    more free block it does both."""
    bm = BlockManager(4, 4)
    bm.allocate("a", 6)
    bm.fork("a", "b")  # blocks 0 and 1 shared: writing position 5 needs a copy of block 1
    bm.allocate("c", 4)  # one block left free
    before = (list(bm.table("a")), [blk.ref_count for blk in bm.blocks], bm.num_free_blocks)
    assert bm.reserve("a", 5, 10) is None
    assert (list(bm.table("a")), [blk.ref_count for blk in bm.blocks], bm.num_free_blocks) == before
    bm.free("c")
    copies = bm.reserve("a", 5, 10)
    table = bm.table("a")
    assert copies == [(1, table[1])] and len(table) == 3 and bm.num_free_blocks == 0
    assert all(bm.blocks[b].ref_count == 1 for b in table[1:]) and bm.blocks[table[0]].ref_count == 2


def test_block_manager_allocate_truncate_free_keeps_the_pool_whole():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.allocate("b", 16)  # 4 blocks
    assert not bm.allocate("c", 8)  # 2 needed, 1 free: refused, nothing taken
    assert bm.num_free_blocks == 1 and not bm.has("c") or bm.table("c") == []
    bm.truncate("a", 5)  # rollback to 5 tokens: 2 blocks
    assert len(bm.table("a")) == 2 and bm.num_free_blocks == 2
    assert bm.slots("a", 3, 6) == [bm.table("a")[0] * 4 + 3, bm.table("a")[1] * 4, bm.table("a")[1] * 4 + 1]
    bm.free("a")
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
